"""Why a child ended, in words and as fields (exit code, signal name, OOM kill)."""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ExitReason:
    """One death of a child: its exit code or the signal that ended it, and who sent it when
    that can be told (the memory limit, the kernel's OOM killer, the supervisor's stop)."""

    code: int | None = None
    signal: str | None = None
    # "memory limit", "oom killer", "not ready", "stopped" or "" (it died on its own).
    cause: str = ""
    detail: str = ""
    at: float = 0.0

    @classmethod
    def from_returncode(cls, returncode: int, cause: str = "", detail: str = "") -> "ExitReason":
        """From a Popen returncode (negative: killed by that signal)."""
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            return cls(signal=name, cause=cause, detail=detail, at=time.time())
        return cls(code=returncode, cause=cause, detail=detail, at=time.time())

    @property
    def oom_killed(self) -> bool:
        return self.cause in ("memory limit", "oom killer")

    def describe(self) -> str:
        what = f"killed by {self.signal}" if self.signal else f"exited with status {self.code}"
        if self.cause:
            what += f" ({self.detail or self.cause})"
        return what

    def to_dict(self) -> dict:
        return {**asdict(self), "oom_killed": self.oom_killed, "text": self.describe()}
