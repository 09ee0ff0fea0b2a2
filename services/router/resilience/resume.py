"""Resuming a broken stream: what the next worker must generate so the client sees no seam.

The next worker gets the original prompt plus every token id already sent to the client as
`generated_ids`, and only the tokens still owed as `max_tokens`. It numbers its tokens from
`len(generated_ids)` and, with a seed, samples what the first worker would have, so the
client's stream continues with nothing lost and nothing repeated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from services.common.generation import FinishReason, Sampling


@dataclass(frozen=True)
class ResumePlan:
    """The continuation of a request after `len(generated_ids)` tokens were sent."""

    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    # max_tokens is what is still owed; 0 when nothing is.
    sampling: Sampling

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens

    @property
    def nothing_left(self) -> bool:
        """Every token the client asked for was sent: finish without another attempt."""
        return self.remaining <= 0

    @property
    def finish_reason(self) -> FinishReason | None:
        """The reason to finish with right away, or None when another attempt is needed."""
        return FinishReason.LENGTH if self.nothing_left else None

    @property
    def next_index(self) -> int:
        """Index of the next token the client will receive (`Resumed.next_index`)."""
        return len(self.generated_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated_ids)


def plan_resume(prompt_ids: Sequence[int], sampling: Sampling, sent_ids: Sequence[int]) -> ResumePlan:
    """Builds the continuation of a request.

    `sampling` is the original request's (not a previous attempt's reduced one) and
    `sent_ids` every token id relayed to the client so far, across all attempts, in order.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if sampling.max_tokens <= 0:
        raise ValueError("the original max_tokens must be > 0")
    # More ids than asked for would be a worker overshooting; what was sent stays sent,
    # and the request is simply complete.
    remaining = max(0, sampling.max_tokens - len(sent_ids))
    return ResumePlan(
        prompt_ids=tuple(prompt_ids),
        generated_ids=tuple(sent_ids),
        sampling=dataclasses.replace(sampling, max_tokens=remaining),
    )
