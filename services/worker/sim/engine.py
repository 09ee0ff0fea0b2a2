"""SimEngine: `services.worker.engine.Engine` without a model.

It validates requests as every engine does (`services.worker.validation`), admits at most
`max_num_seqs` at once (the rest wait, lower priority value first: tier S before A before B,
a resumed stream one tier ahead, as `EngineRequest.scheduling_priority` ranks them), sleeps
for prefill (shortened by prefix-cache hits of the same tenant; a long prompt in chunks, a
step each) and for each decode step as the profile says, counting the steps, and streams
token ids from `tokens` over the model folder's real tokenizer, with the same incremental
detokenization and stop strings as the other engines.
Waiting is sleeping, so a sim worker uses almost no CPU: many of them measure Ballast, not
model compute. EOS ids are never drawn; a stream ends at max_tokens or a stop string.
A request with a JSON Schema (`response_format`) is drawn under the schema's grammar
(`guided_draw`) and ends by the rules every engine follows (`services.worker.guided`): its
resumed ids must fit the grammar, and it stops once its document is complete.

`faults` (services.worker.sim.faults) makes it misbehave on purpose: fail streams after k
tokens, hang, run slower, take its time to start, or die on a request whose prompt holds a
marker (`on_crash` says how it dies: the worker process exits).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
import secrets
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

from services.common.errors import Unavailable
from services.worker.detokenizer import TextStream, finished_before_start
from services.worker.engine import EngineRequest, EngineStats, FinishReason, ModelDescription, Stepping, TokenDelta
from services.worker.model_files import describe_model
from services.worker.sim.faults import SimFaults
from services.worker.sim.prefix import PrefixCache
from services.worker.sim.profile import SimProfile
from services.worker.sim.tokens import TokenSource
from services.worker.validation import validate_request

if TYPE_CHECKING:
    from services.worker.guided import GuideCompiler, JsonGuide
    from services.worker.sim.guided_draw import GuidedDraw

log = logging.getLogger(__name__)

_HANG_POLL_S = 0.05


class _Slots:
    """`size` running at once; waiters admitted by (priority, arrival)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.running = 0
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, future in self._waiters if not future.done())

    async def acquire(self, priority: int) -> None:
        if self.running < self.size and not self.waiting:
            self.running += 1
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # admitted and cancelled in the same instant: hand the slot on
            raise

    def release(self) -> None:
        self.running -= 1
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                self.running += 1
                future.set_result(None)
                return


class SimEngine(Stepping):
    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        profile: SimProfile | None = None,
        *,
        max_concurrency: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        faults: SimFaults | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        self.profile = profile or SimProfile()
        self.faults = faults or SimFaults()
        description = describe_model(Path(model_dir), model_name)
        # The model's own EOS ids end a guided document, even with EOS switched off.
        self._model_eos = description.eos_token_ids
        if eos_token_ids is not None:
            description = replace(description, eos_token_ids=tuple(int(i) for i in eos_token_ids))
        self._description = description
        self._tokenizer = Tokenizer.from_str(description.tokenizer_json.decode("utf-8"))
        self._vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        special = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        ordinary = sorted(i for token, i in vocab.items() if token not in special)
        self._tokens = TokenSource(ordinary)
        # Built on the first request with a JSON Schema (llguidance, from the torch extra).
        self._guides: GuideCompiler | None = None
        self._guided_draw: GuidedDraw | None = None
        self._slots = _Slots(max_concurrency or self.profile.max_num_seqs)
        self._prefix = PrefixCache(self.profile.kv_blocks, self.profile.block_tokens)
        self._rng = random.Random(self.profile.seed)
        self._kv_tokens: dict[int, int] = {}
        # Their sum, kept as they change: every decode step of every stream reads it, and
        # summing a thousand streams' counts per token would be the sim worker's main cost.
        self._kv_total = 0
        self._ids = itertools.count()
        self._generated_total = 0
        self._steps = 0
        self._serving = False
        # What `crash_on_marker` does: the worker sets it (the process exits); unset, the
        # stream fails as if the engine had died.
        self.on_crash: Callable[[], None] | None = None

    @property
    def model(self) -> ModelDescription:
        return self._description

    async def start(self) -> None:
        await asyncio.sleep(self.faults.ready_delay_s)
        self._serving = True

    def set_faults(self, faults: SimFaults) -> None:
        """New fault knobs; streams already running follow them from their next step."""
        self.faults = faults

    async def stop(self) -> None:
        self._serving = False

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        validate_request(request, self._vocab_size, self._description.max_context)
        guide = self._guide(request) if request.response_format else None
        return self._generate(request, guide)

    def _guide(self, request: EngineRequest) -> JsonGuide:
        """The request's grammar, fast-forwarded over its generated ids; InvalidArgument for a
        schema that cannot be guided and for generated ids that leave it."""
        from services.worker.guided import GuideCompiler
        from services.worker.sim.guided_draw import GuidedDraw

        if self._guides is None:
            self._guides = GuideCompiler(self._description.tokenizer_json, self._vocab_size, self._model_eos)
            ordinary = self._tokens.ordinary_ids
            self._guided_draw = GuidedDraw(self._tokens, [self._tokenizer.decode([i]) for i in ordinary])
        return self._guides.for_request(request.response_format, request.generated_ids)

    async def _sleep(self, ms: float) -> None:
        """One step of a sequence: its wait, then the step counted."""
        await asyncio.sleep(self.profile.jittered(ms, self._rng) * self.faults.slowdown / 1000)
        while self.faults.hang:
            # Polled: a hung engine produces nothing until the knob is cleared.
            await asyncio.sleep(_HANG_POLL_S)
        self._steps += 1

    @property
    def steps(self) -> int:
        """Steps computed: each sequence's prefill chunks and decode steps (`Stepping`)."""
        return self._steps

    def _check_fail_after(self, produced: int) -> None:
        limit = self.faults.fail_after_tokens
        if limit is not None and produced >= limit:
            raise Unavailable(f"sim fault: the engine failed after {limit} tokens")

    def _check_marker(self, request: EngineRequest) -> None:
        marker = self.faults.crash_on_marker
        if marker is None or marker not in self._tokenizer.decode(list(request.prompt_ids)):
            return
        log.warning("sim fault: request %s holds the crash marker; the engine dies", request.request_id)
        if self.on_crash is not None:
            self.on_crash()
        raise Unavailable("sim fault: the engine died on the crash marker")

    def _seed(self, request: EngineRequest) -> int:
        s = request.sampling
        if s.temperature == 0:
            return 0
        # Offset from greedy's 0, so a sampled stream with seed 0 is not the greedy one.
        return (s.seed + 1) if s.seed is not None else secrets.randbits(62) + 1

    async def _generate(self, request: EngineRequest, guide: JsonGuide | None) -> AsyncIterator[TokenDelta]:
        s = request.sampling
        text = TextStream(self._tokenizer, s.stop, initial_ids=request.generated_ids)
        done = finished_before_start(text, s.max_tokens)
        if done is not None:
            yield done
            return
        if not self._serving:
            raise Unavailable("the sim engine is not running")
        seed = self._seed(request)
        prompt_key = self._tokens.prompt_key(request.prompt_ids)
        context = [*request.prompt_ids, *request.generated_ids]
        key = next(self._ids)
        # As the other engines admit: by tier, a resumed stream one tier ahead (EngineRequest).
        await self._slots.acquire(request.scheduling_priority)
        try:
            self._kv_tokens[key] = len(context)
            self._kv_total += len(context)
            uncached = len(context) - self._prefix.cached_tokens(request.tenant, context)
            for step_ms in self.profile.prefill_steps_ms(uncached):
                await self._sleep(step_ms)
            self._prefix.remember(request.tenant, context)
            self._check_marker(request)
            if guide is not None:
                # Imported here: llguidance comes with the torch extra, which a sim worker
                # serving no guided request does not need.
                from services.worker.guided import DocumentEnd, document_end
            first = True
            for i in range(s.max_tokens):
                if i:
                    await self._sleep(self.profile.decode_step_ms(self._slots.running, self._kv_total))
                self._check_fail_after(i)
                complete = False  # the guided document ended with this token
                if guide is None:
                    token = self._tokens.token(seed, prompt_key, len(context) + i)
                else:
                    assert self._guided_draw is not None
                    token = self._guided_draw.next_token(guide, seed, prompt_key, len(context) + i)
                    guide.advance(token)
                    end = document_end(guide, token)
                    complete = end is DocumentEnd.COMPLETE
                    if end is DocumentEnd.AT_EOS:  # the EOS itself is never sent
                        yield TokenDelta(
                            [], text.finish(), FinishReason.STOP, prefill_tokens=uncached if first else None
                        )
                        return
                self._kv_tokens[key] += 1
                self._kv_total += 1
                self._generated_total += 1
                piece, stopped = text.push(token)
                finish = None
                if stopped:
                    finish = FinishReason.STOP
                elif i == s.max_tokens - 1 or complete:
                    piece += text.finish()
                    finish = FinishReason.STOP if text.stopped or complete else FinishReason.LENGTH
                yield TokenDelta([token], piece, finish, prefill_tokens=uncached if first else None)
                first = False
                if finish is not None:
                    return
        finally:
            self._kv_total -= self._kv_tokens.pop(key, 0)
            self._slots.release()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._slots.running,
            waiting=self._slots.waiting,
            kv_tokens=min(self._kv_total, self.profile.kv_capacity_tokens),
            kv_capacity_tokens=self.profile.kv_capacity_tokens,
            extra={"max_concurrency": float(self._slots.size), "generated_tokens_total": float(self._generated_total)},
        )
