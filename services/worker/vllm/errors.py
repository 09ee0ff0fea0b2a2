"""vLLM's exceptions as Ballast's typed errors.

The distinction that matters downstream: a bad request (InvalidArgument) fails the same on
every replica, never counts against this worker and is never retried; anything else from
vLLM (Unavailable) lets the router resume the stream on another replica, and a dead engine
says so, because only a restart brings this worker back.

Errors are classified by type, never by their text: the classes come from the installed vLLM
(`api.detect_vllm_api` finds them once: VLLMClientError and VLLMValidationError for bad
requests, EngineDeadError for a dead engine), and a bare ValueError, which some of vLLM's
validation still raises, is bad input too. AsyncLLM.generate wraps unexpected errors in
EngineGenerateError with the cause attached, so the cause chain is searched as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from services.common.errors import BallastError, InvalidArgument, Unavailable


@dataclass(frozen=True)
class VllmErrorTypes:
    """The installed vLLM's exception classes, by what they mean."""

    client: tuple[type[BaseException], ...] = ()  # the request is bad: the same on every replica
    dead: tuple[type[BaseException], ...] = ()  # the engine process is gone for good


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        # Only explicit wrapping (`raise X from cause`): an error that merely happened while
        # another was handled is not caused by it.
        current = current.__cause__
    return seen


def map_vllm_error(
    exc: BaseException, types: VllmErrorTypes, engine_dead: Callable[[], bool] = lambda: False
) -> BallastError:
    """The Ballast error to raise for an exception out of vLLM's generate()."""
    chain = _chain(exc)
    for error in chain:
        if isinstance(error, BallastError):
            return error
        message = str(error) or type(error).__name__
        if types.dead and isinstance(error, types.dead):
            return Unavailable(f"the vLLM engine is dead ({message}); this worker needs a restart")
        if (types.client and isinstance(error, types.client)) or isinstance(error, ValueError):
            return InvalidArgument(f"vLLM refused the request: {message}")
    # EngineGenerateError says nothing itself: name the error it wraps.
    root = chain[-1]
    what = f"{type(root).__name__}: {root}"
    if engine_dead():
        return Unavailable(f"the vLLM engine is dead ({what}); this worker needs a restart")
    return Unavailable(f"the vLLM engine failed this request ({what})")
