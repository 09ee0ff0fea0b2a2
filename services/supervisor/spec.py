"""What the supervisor runs: one `ChildSpec` per child process."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common.backoff import BackoffPolicy

# The restart policy is the shared backoff rule (services/common/backoff.py).
RestartPolicy = BackoffPolicy


@dataclass
class ChildSpec:
    """One supervised child. Children start in the order given (all of one `stage` launched
    together, then waited for); they stop in the reverse order."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    # Answers True once the child serves; None: ready as soon as it runs. A probe that raises
    # means "not yet".
    ready: Callable[[], bool] | None = None
    stage: int = 0
    start_timeout_s: float = 60.0
    # SIGTERM first; SIGKILL to the group after this long.
    stop_grace_s: float = 10.0
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    # 0: no limit. Over it (RSS of the child and its descendants), the child is SIGKILLed.
    memory_limit_mb: int = 0
    # Called with each new incarnation's ManagedProcess (a launcher keeping its own view).
    on_started: Callable[[object], None] | None = None
    # Shown in the state file (e.g. the address it serves on).
    address: str = ""
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"child {self.name!r}: argv must not be empty")
        if self.memory_limit_mb < 0:
            raise ValueError(f"child {self.name!r}: memory_limit_mb must be >= 0")
