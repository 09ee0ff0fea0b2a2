"""Refuses a prompt that cannot fit its model's context even when no worker would count it.

A worker's router counts a prompt's tokens when a worker takes it (`fit_request` in the
runner) and refuses what cannot fit as INVALID_ARGUMENT. With no routable worker the request
would go straight down the degradation ladder instead, and an over-long prompt would get a
degraded 200. The guard counts it first, with the tokenizer the router last learnt for the
model (kept after its workers are gone), by the same policy, so the refusal is the same
whether or not a worker is alive. A router that has never learnt the model's tokenizer cannot
count tokens: it lets the request down the ladder as before.
"""

from __future__ import annotations

from typing import Callable

from services.router.context.window import fit_request_async


class ContextGuard:
    """`tokenizer_of(model)` gives the last ModelTokenizer learnt for a logical model (or None);
    `routable(model)` says whether a worker would count the prompt itself."""

    def __init__(self, tokenizer_of: Callable[[str], object | None], routable: Callable[[str], bool]) -> None:
        self._tokenizer_of = tokenizer_of
        self._routable = routable

    async def check(self, request) -> None:
        """Raises InvalidArgument (with the counts) when the request's prompt cannot fit the
        model's context by its policy and no worker is there to say so. A big prompt is
        counted on a thread, as on the worker path."""
        if self._routable(request.model):
            # The worker path counts exactly once; counting here too would cost every request.
            return
        tokenizer = self._tokenizer_of(request.model)
        if tokenizer is None:
            return
        await fit_request_async(request, tokenizer, policy=request.context_policy, max_turns=request.max_turns)
