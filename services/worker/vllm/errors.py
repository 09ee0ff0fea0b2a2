"""vLLM's exceptions as Ballast's typed errors.

The distinction that matters downstream: a bad request (InvalidArgument) fails the same on
every replica, never counts against this worker and is never retried; anything else from
vLLM (Unavailable) lets the router resume the stream on another replica, and a dead engine
says so, because only a restart brings this worker back.

vLLM's classes moved between releases (EngineDeadError in V1, AsyncEngineDeadError before;
VLLMValidationError subclasses ValueError in some releases and not in others), and
AsyncLLM.generate wraps unexpected errors in EngineGenerateError with the cause attached.
So errors are matched by class name along the MRO and the cause chain, which needs no vLLM
import and works on every release.
"""

from __future__ import annotations

from typing import Callable

from services.common.errors import BallastError, InvalidArgument, Unavailable

_DEAD = frozenset({"EngineDeadError", "AsyncEngineDeadError"})
_CLIENT = frozenset({"VLLMValidationError", "VLLMClientError"})
# ValueError messages that vLLM raises when a prompt does not fit the model.
_LENGTH_HINTS = ("maximum model length", "max_model_len", "maximum context length", "too long")


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        # Only explicit wrapping (`raise X from cause`): an error that merely happened while
        # another was handled is not caused by it.
        current = current.__cause__
    return seen


def map_vllm_error(exc: BaseException, engine_dead: Callable[[], bool] = lambda: False) -> BallastError:
    """The Ballast error to raise for an exception out of vLLM's generate()."""
    chain = _chain(exc)
    for error in chain:
        if isinstance(error, BallastError):
            return error
        names = _names(error)
        message = str(error) or type(error).__name__
        if names & _DEAD:
            return Unavailable(f"the vLLM engine is dead ({message}); this worker needs a restart")
        if names & _CLIENT or isinstance(error, ValueError):
            if any(hint in message.lower() for hint in _LENGTH_HINTS):
                return InvalidArgument(f"the prompt does not fit this worker's model: {message}")
            return InvalidArgument(f"vLLM refused the request: {message}")
    # EngineGenerateError says nothing itself: name the error it wraps.
    root = chain[-1]
    what = f"{type(root).__name__}: {root}"
    if engine_dead():
        return Unavailable(f"the vLLM engine is dead ({what}); this worker needs a restart")
    return Unavailable(f"the vLLM engine failed this request ({what})")
