"""The scheduler side of Ballast's vLLM KV connector, as pure bookkeeping: which stored
blocks a request can load, and which of its blocks each engine step should save.

vLLM's scheduler asks the connector, per waiting request, how many tokens beyond its own
prefix cache the store can provide (`SchedulerBook.matched`, one Lookup on the cache
service), tells it what it allocated (`allocated`), then, once per step, asks for the
metadata the worker side acts on (`plan`): blocks to load into freshly allocated pages
before the forward pass, and blocks that the step completes, to copy out after it and save.

Saving as blocks fill (rather than when the request ends) means the worker side copies pages
while they certainly hold this request's tokens, and vLLM never has to hold pages for a save
in progress. Blocks the store already had (the lookup said so) or that were just loaded from
it are not written again. Only requests the worker marked as sessions are tracked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from services.worker.vllm.kv_keys import ConnectorKeys


@dataclass(frozen=True)
class BlockMove:
    """Stored blocks [first_block, first_block + len(names)) of one request and the vLLM
    pages that hold each (in token order)."""

    request_id: str
    tenant: str
    first_block: int
    names: tuple[bytes, ...]
    pages: tuple[tuple[int, ...], ...]
    # Leading pages of the first block that vLLM's own prefix cache already filled (loads).
    skip_pages: int = 0


@dataclass(frozen=True)
class StepPlan:
    loads: tuple[BlockMove, ...] = ()
    saves: tuple[BlockMove, ...] = ()


@dataclass(frozen=True)
class ScheduledNew:
    request_id: str
    page_ids: Sequence[int]
    computed_tokens: int  # before this step, including tokens loaded from the store
    scheduled_tokens: int


@dataclass(frozen=True)
class ScheduledCached:
    request_id: str
    new_page_ids: Sequence[int] | None
    resumed: bool  # back from preemption: new_page_ids is its whole page table
    computed_tokens: int
    scheduled_tokens: int


@dataclass
class _Tracked:
    tenant: str
    tokens: Callable[[], Sequence[int]]  # the request's token ids so far (prompt + output)
    stored_blocks: int = 0  # blocks of its context the store already holds
    local_tokens: int = 0  # tokens vLLM's prefix cache had when the load was decided
    load_tokens: int = 0  # tokens the store provides beyond those
    load_confirmed: bool = False
    pages: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # blocks [0, saved_blocks) are in the store or on their way


class SchedulerBook:
    def __init__(self, keys: ConnectorKeys) -> None:
        self.keys = keys
        self._tracked: dict[str, _Tracked] = {}

    def tracks(self, request_id: str) -> bool:
        return request_id in self._tracked

    def matched(
        self,
        request_id: str,
        tenant: str,
        tokens: Callable[[], Sequence[int]],
        computed_tokens: int,
        lookup: Callable[[list[bytes]], int],
    ) -> int:
        """Tokens the store can load beyond `computed_tokens`. The lookup runs once per
        request: vLLM asks again while it waits for pages, and the answer holds."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            tracked = _Tracked(tenant, tokens)
            names = self.keys.lookup_names(tenant, tokens())
            tracked.stored_blocks = lookup(names) if names else 0
            tracked.saved_blocks = tracked.stored_blocks
            self._tracked[request_id] = tracked
        context = len(tracked.tokens())
        tracked.local_tokens = computed_tokens
        tracked.load_tokens = self.keys.loadable_tokens(context, tracked.stored_blocks, computed_tokens)
        return tracked.load_tokens

    def allocated(self, request_id: str, external_tokens: int) -> None:
        """vLLM allocated pages for `external_tokens` loaded tokens (0: it loads none)."""
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            tracked.load_confirmed = external_tokens > 0 and external_tokens == tracked.load_tokens

    def plan(self, new: Sequence[ScheduledNew], cached: Sequence[ScheduledCached]) -> StepPlan:
        loads: list[BlockMove] = []
        saves: list[BlockMove] = []
        for request in new:
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                continue
            tracked.pages = list(request.page_ids)
            if tracked.load_confirmed:
                loads.append(self._load(request.request_id, tracked))
                tracked.load_confirmed = False
            self._save(request.request_id, tracked, request.computed_tokens + request.scheduled_tokens, saves)
        for request in cached:
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                continue
            if request.resumed:
                tracked.pages = list(request.new_page_ids or ())
            elif request.new_page_ids:
                tracked.pages.extend(request.new_page_ids)
            self._save(request.request_id, tracked, request.computed_tokens + request.scheduled_tokens, saves)
        return StepPlan(tuple(loads), tuple(saves))

    def finished(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def _load(self, request_id: str, tracked: _Tracked) -> BlockMove:
        block = self.keys.block_tokens
        first = tracked.local_tokens // block
        end = (tracked.local_tokens + tracked.load_tokens) // block
        names = self.keys.block_names(tracked.tenant, tracked.tokens(), end)[first:end]
        pages = tuple(tuple(self.keys.pages_of(i, tracked.pages)) for i in range(first, end))
        skip = (tracked.local_tokens - first * block) // self.keys.page_tokens
        tracked.saved_blocks = max(tracked.saved_blocks, end)
        return BlockMove(request_id, tracked.tenant, first, tuple(names), pages, skip)

    def _save(self, request_id: str, tracked: _Tracked, computed_after_step: int, saves: list[BlockMove]) -> None:
        tokens = tracked.tokens()
        full = min(computed_after_step, len(tokens)) // self.keys.block_tokens
        # Only blocks whose pages vLLM has allocated (the page table can trail by a step).
        full = min(full, len(tracked.pages) // self.keys.pages_per_block)
        if full <= tracked.saved_blocks:
            return
        first = tracked.saved_blocks
        names = self.keys.block_names(tracked.tenant, tokens, full)[first:full]
        pages = tuple(tuple(self.keys.pages_of(i, tracked.pages)) for i in range(first, full))
        saves.append(BlockMove(request_id, tracked.tenant, first, tuple(names), pages))
        tracked.saved_blocks = full
