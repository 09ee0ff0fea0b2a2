"""The torch engine: a Hugging Face causal LM folder run with torch, on CPU (or CUDA).

For development, CI and demos, with a real tokenizer and a real KV cache per sequence. The
model runs through `services.worker.torch.model_runner`: a plain-torch Llama-family decoder that
batches decode steps, or transformers for any other model. All model compute runs in one
dedicated thread, off the event loop, ordered by `services.worker.torch.step_scheduler`: each
request submits its prefill (in chunks) and then one decode step per token; the decode steps
of all running sequences go through the model together, and the most urgent tier's work goes
first, so a long prompt does not stall the others and an S-tier prompt does not wait behind
B-tier decoding. Admission is
bounded: at most `max_concurrency` sequences run, at most `max_waiting` wait for a slot, and
beyond that a request is refused with ResourceExhausted. Closing or cancelling a stream frees
its slot and KV cache at once.

Sessions: a request with a session_id starts from the longest prefix of its context whose KV
is already known, instead of recomputing it: from a small LRU of recent sessions' caches in
this process (`memory_sessions`), or else restored from the cache service (`attach_kv`),
when the measured cost says restoring beats recomputing. The context's last token is always
computed fresh. When the turn ends its KV goes back to the LRU and is queued for saving.
"""

from __future__ import annotations

import logging

import asyncio
import os
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import torch

from services.common.errors import ResourceExhausted, Unavailable
from services.worker.detokenizer import TextStream, finished_before_start
from services.worker.guided import DocumentEnd, GuideCompiler, document_end
from services.worker.engine import (
    ChunkedPrefill,
    EngineRequest,
    EngineStats,
    FinishReason,
    KvAttachable,
    ModelDescription,
    Stepping,
    TokenDelta,
)
from services.worker.model_files import describe_model
from services.worker.torch.model_runner import load_runner
from services.worker.sampling import fresh_seed, position_generator, select_token
from services.worker.torch.step_scheduler import DecodeStep, PrefillStep, StepScheduler
from services.worker.torch.tokenizer import load_tokenizer
from services.worker.validation import validate_request

log = logging.getLogger(__name__)


class _Sequence:
    """One running request: its KV cache, the tokens the cache holds, and the compute time
    of its last prefill (its share of a batched pass; read back on the loop to feed the cost
    estimates)."""

    __slots__ = ("cache", "length", "ids", "last_ms")

    def __init__(self) -> None:
        self.cache: Any = None
        self.length = 0
        self.ids: list[int] = []
        self.last_ms = 0.0


class _SessionMemory:
    """The KV caches of the most recent finished sessions, at most `capacity` of them.

    An entry is taken out while its session runs (two concurrent turns of one session never
    share a cache) and put back, with its new tokens, when the turn ends."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], tuple[tuple[int, ...], Any]] = OrderedDict()

    def take(self, key: tuple[str, str]) -> tuple[tuple[int, ...], Any] | None:
        return self._entries.pop(key, None)

    def put(self, key: tuple[str, str], ids: tuple[int, ...], cache: Any) -> None:
        if self.capacity <= 0:
            return
        self._entries.pop(key, None)
        self._entries[key] = (ids, cache)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids, _cache in self._entries.values())


class TorchEngine(KvAttachable, ChunkedPrefill, Stepping):
    """`services.worker.engine.Engine` on transformers, with session KV (`attach_kv`) and
    chunked prefill."""

    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        max_concurrency: int = 8,
        device: str = "auto",
        *,
        max_waiting: int | None = None,
        kv_capacity_tokens: int | None = None,
        torch_threads: int | None = None,
        prefill_chunk: int = 512,
        eos_token_ids: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        memory_sessions: int = 0,
        runtime: str = "auto",
        max_batch: int = 64,
    ) -> None:
        """`max_waiting` bounds the requests queued for a slot (default 4 x concurrency).
        `eos_token_ids` overrides the model's (an empty tuple disables EOS, for benchmarks
        that need fixed-length outputs). `torch_threads` is process-wide in torch.
        `memory_sessions` is how many recent sessions' KV caches stay in memory for reuse.
        `runtime` picks the model runner (services.worker.torch.model_runner); `max_batch` bounds
        the decode steps of one forward pass."""
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self._dir = Path(model_dir)
        description = describe_model(self._dir, model_name)
        if eos_token_ids is not None:
            description = _replace_eos(description, eos_token_ids)
        self._description = description
        self._eos = frozenset(description.eos_token_ids)
        self._max_concurrency = max_concurrency
        self._max_waiting = 4 * max_concurrency if max_waiting is None else max_waiting
        self._kv_capacity = kv_capacity_tokens or max_concurrency * description.max_context
        self._device = _pick_device(device)
        self._dtype = dtype or torch.float32
        # Measured on 2 cores: a second intra-op thread made decode steps slower (the event
        # loop and gRPC need a core too), so use half the cores, at most 2.
        self._threads = torch_threads or max(1, min(2, (os.cpu_count() or 2) // 2))
        self._prefill_chunk = max(1, prefill_chunk)
        self._sessions = _SessionMemory(memory_sessions)
        self._kv: Any = None  # SessionKV, when KV persistence is attached
        self._kv_metrics: Any = None
        self._kv_layout: Any = None

        self._runtime = runtime
        self._tokenizer = load_tokenizer(self._dir)
        self._vocab_size = _config_vocab_size(self._dir) or len(self._tokenizer)
        # Guided decoding (JSON Schema). The model's own EOS ids, even when EOS is switched
        # off for benchmarks, or a guided answer could never end.
        model_eos = describe_model(self._dir, model_name).eos_token_ids
        self._guides = GuideCompiler(description.tokenizer_json, self._vocab_size, model_eos)
        self._runner: Any = None
        self._steps = StepScheduler(
            self._decode_batch,
            max_batch=max_batch,
            run_prefills=self._prefill_batch,
            max_prefill_tokens=self._prefill_chunk,
        )
        self._slots: asyncio.Semaphore | None = None
        self._running = 0
        self._waiting = 0
        self._kv_tokens = 0
        self._generated_total = 0
        self._step_seconds = 0.0
        self._forwards = 0

    # --- lifecycle ------------------------------------------------------------------
    @property
    def model(self) -> ModelDescription:
        return self._description

    async def start(self) -> None:
        if self._steps.running:
            return
        self._steps.start()
        self._slots = asyncio.Semaphore(self._max_concurrency)
        await self._steps.call(self._load)

    def _load(self) -> None:
        if self._device.type == "cpu":
            torch.set_num_threads(self._threads)
        # Pool slots for the running sequences, the session memory's caches, and the copies a
        # truncation or restore makes while the original still lives.
        pool_slots = 2 * self._max_concurrency + self._sessions.capacity
        self._runner = load_runner(self._dir, self._dtype, self._device, self._runtime, pool_slots)
        self._warm_up()
        log.info("%s: %s runtime on %s", self._description.name, self._runner.name, self._device)

    def _warm_up(self) -> None:
        """Runs a small batched prefill and a decode step before the worker takes requests.
        torch's first passes pay one-time costs (allocator growth, kernel and thread-pool set-up:
        a few milliseconds on CPU, far more on a GPU); without this they land on the first
        requests, which after a crash elsewhere are resumed streams whose users already wait."""
        ids = [i % self._vocab_size for i in range(1, 17)]
        _logits, caches = self._runner.prefill_many([None, None], [ids, ids[:8]])
        self._runner.decode(caches, [ids[0], ids[1]])

    @property
    def prefill_chunk(self) -> int:
        return self._prefill_chunk

    @property
    def steps(self) -> int:
        """Batches and calls the compute thread finished (`Stepping`)."""
        return self._steps.completed

    def attach_kv(self, metrics: Any, session_kv: Any = None) -> bool:
        """Reports KV reuse through `metrics` (services.worker.kv.KVMetrics) and, with a
        `session_kv` (services.worker.kv.SessionKV), restores and saves sessions through the
        cache service. Call after start(). False when this model's KV cannot be stored."""
        self._kv_metrics = metrics
        if session_kv is None:
            return True
        from services.worker.kv.tensors import model_layout

        layout = model_layout(self._runner.config, self._dtype, session_kv.settings.block_tokens)
        if layout is None:
            return False
        session_kv.bind(self._description.version, layout)
        self._kv, self._kv_layout = session_kv, layout
        return True

    async def stop(self) -> None:
        """Stop taking requests; the step in progress finishes, later steps fail Unavailable."""
        await self._steps.stop()
        self._runner = None

    # --- requests -------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as is: no BOS added (a rendered chat template carries it)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Validate now (bad input raises InvalidArgument before anything starts), then stream
        one TokenDelta per generated token; the last one carries the finish reason."""
        validate_request(request, self._vocab_size, self._description.max_context)
        return self._generate(request)

    async def _generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        s = request.sampling
        text = TextStream(self._tokenizer, s.stop, initial_ids=request.generated_ids)
        done = finished_before_start(text, s.max_tokens)
        if done is not None:
            yield done
            return
        seed = fresh_seed() if s.seed is None else s.seed
        priority = request.scheduling_priority
        start_pos = len(request.generated_ids)
        context = [*request.prompt_ids, *request.generated_ids]
        guide = None
        if request.response_format:
            # Compiled on the engine thread (it is CPU work); a resumed stream continues the
            # grammar from the tokens already generated, or is refused (InvalidArgument).
            guide = await self._steps.call(
                self._guides.for_request, request.response_format, request.generated_ids, priority=priority
            )

        async with self._slot():
            seq = _Sequence()
            finished = False
            try:
                reused = await self._reuse_prefix(request, context, seq, priority)
                computed = len(context) - reused
                # Prefill in chunks, each its own job, so other sequences step in between.
                for i in range(reused, len(context), self._prefill_chunk):
                    chunk = context[i : i + self._prefill_chunk]
                    last = i + self._prefill_chunk >= len(context)
                    token = await self._steps.prefill(
                        seq, chunk, (s, seed, start_pos, guide) if last else None, priority
                    )
                    self._grow(seq, len(chunk))
                    if self._kv is not None:
                        self._kv.cost.observe_prefill(i, len(chunk), seq.last_ms)
                if self._kv_metrics is not None and request.session_id:
                    self._kv_metrics.prefix_tokens.add(computed, {"source": "computed"})
                first = True
                for k in range(s.max_tokens):
                    if k:
                        token = await self._steps.decode(seq, token, (s, seed, start_pos + k, guide), priority)
                        self._grow(seq, 1)
                    self._generated_total += 1
                    # The first delta says how much of the context was actually computed.
                    prefill = computed if first else None
                    first = False
                    end = document_end(guide, token) if guide is not None else None
                    if token in self._eos or end is DocumentEnd.AT_EOS:
                        finished = True
                        yield TokenDelta([], text.finish(), FinishReason.STOP, prefill_tokens=prefill)
                        return
                    delta, stopped = text.push(token)
                    if end is DocumentEnd.COMPLETE:
                        # The JSON document is complete: only EOS could follow.
                        finished = True
                        yield TokenDelta([token], delta + text.finish(), FinishReason.STOP, prefill_tokens=prefill)
                        return
                    if stopped:
                        finished = True
                        yield TokenDelta([token], delta, FinishReason.STOP, prefill_tokens=prefill)
                        return
                    if k == s.max_tokens - 1:
                        delta += text.finish()
                        reason = FinishReason.STOP if text.stopped else FinishReason.LENGTH
                        finished = True
                        yield TokenDelta([token], delta, reason, prefill_tokens=prefill)
                        return
                    yield TokenDelta([token], delta, prefill_tokens=prefill)
            finally:
                # Runs on normal end, aclose() and cancellation alike: the KV goes now. A
                # finished turn's KV goes on to the session memory and the save queue; after a
                # cancellation a forward pass may still be writing into it, so it is dropped.
                self._kv_tokens -= seq.length
                if finished and request.session_id and seq.cache is not None:
                    self._keep_session(request, seq)
                seq.cache, seq.length = None, 0

    def _grow(self, seq: _Sequence, n: int) -> None:
        seq.length += n
        self._kv_tokens += n

    # --- session KV reuse -------------------------------------------------------------
    async def _reuse_prefix(self, request: EngineRequest, context: list[int], seq: _Sequence, priority: int) -> int:
        """Loads the longest known KV prefix of `context` into `seq`; returns its length."""
        if not request.session_id:
            return 0
        from services.worker.kv.tensors import common_prefix

        key = (request.tenant, request.session_id)
        held = self._sessions.take(key)
        if held is not None:
            ids, cache = held
            usable = min(common_prefix(ids, context), len(context) - 1)
            if usable > 0:
                if usable < len(ids):
                    cache = await self._steps.call(self._runner.truncated, cache, usable, priority=priority)
                seq.cache, seq.ids = cache, list(context[:usable])
                self._grow(seq, usable)
                if self._kv_metrics is not None:
                    self._kv_metrics.prefix_tokens.add(usable, {"source": "memory"})
                return usable
        if self._kv is None or not self._kv.applies_to(request.session_id):
            return 0
        fetch = await self._kv.fetch(request.tenant, context)
        if fetch is None:
            return 0
        good, cache = await self._steps.call(self._load_restored, fetch.blocks, priority=priority)
        tokens = self._kv.restored(fetch, good)
        if not tokens:
            return 0
        seq.cache, seq.ids = cache, list(context[:tokens])
        self._grow(seq, tokens)
        self._kv_metrics.prefix_tokens.add(tokens, {"source": "cache"})
        return tokens

    def _load_restored(self, fetched: Any) -> tuple[int, Any]:
        """Verifies fetched blocks and builds a cache of the good ones (engine thread)."""
        from services.worker.kv.tensors import verify_and_decode

        good, pairs = verify_and_decode(fetched, self._device)
        if not good:
            return 0, None
        return good, self._runner.from_pairs(pairs)

    def _keep_session(self, request: EngineRequest, seq: _Sequence) -> None:
        """Hands a finished sequence's KV to the session memory and the save queue."""
        from services.worker.kv.tensors import cache_pairs, encode_blocks, fits

        cache, ids = seq.cache, tuple(seq.ids)
        if not ids or cache.get_seq_length() != len(ids):  # defensive: never keep a mismatch
            return
        self._sessions.put((request.tenant, request.session_id), ids, cache)
        if self._kv is None:
            return
        pairs, layout = cache_pairs(cache), self._kv_layout
        if not fits(pairs, layout, len(ids)):
            return

        def encode(first: int, end: int):
            # `pairs` are views of the cache's buffers; a pooled cache's slot is reused once the
            # cache is collected, so the closure holds the cache until the save is done.
            _ = cache
            return encode_blocks(pairs, layout, first, end)

        self._kv.save(request.tenant, request.session_id, ids, encode)

    # --- model compute (engine thread only) ----------------------------------------
    def _prefill_batch(self, steps: Sequence[PrefillStep]) -> list[int | BaseException]:
        """Each step's ids run on its sequence's cache, in one forward pass where the runner
        batches; a step with `sample` gets the token sampled after its last id, else -1."""
        started = time.perf_counter()
        logits, caches = self._runner.prefill_many([step.seq.cache for step in steps], [step.ids for step in steps])
        elapsed = time.perf_counter() - started
        tokens = sum(len(step.ids) for step in steps)
        for step in steps:
            # The pass's time, shared by tokens: what the KV cost model learns from.
            step.seq.last_ms = 1000 * elapsed * len(step.ids) / tokens
        self._count_forward(elapsed)
        return self._after_pass(steps, logits, caches, [step.ids for step in steps])

    def _decode_batch(self, steps: Sequence[DecodeStep]) -> list[int | BaseException]:
        """One token for each step's sequence, in one forward pass where the runner batches.
        A stream cancelled after its step was queued releases its cache (on the loop) while the
        batch waits for this thread: its step is answered with an error, the others run."""
        caches = [step.seq.cache for step in steps]  # read once: the loop may release one meanwhile
        live = [i for i, cache in enumerate(caches) if cache is not None]
        results: list[int | BaseException] = [Unavailable("the stream ended before its step ran")] * len(steps)
        if live:
            started = time.perf_counter()
            logits, new = self._runner.decode([caches[i] for i in live], [steps[i].token for i in live])
            self._count_forward(time.perf_counter() - started)
            ran = self._after_pass([steps[i] for i in live], logits, new, [[steps[i].token] for i in live])
            for i, result in zip(live, ran):
                results[i] = result
        return results

    def _after_pass(
        self,
        steps: Sequence[PrefillStep | DecodeStep],
        logits: torch.Tensor,
        caches: Sequence[Any],
        inputs: Sequence[Sequence[int]],
    ) -> list[int | BaseException]:
        """Each sequence takes its new cache and the ids it ran; per step, the token sampled
        from its row of `logits` (-1 for a step that does not sample), or the exception that
        step alone failed with (a grammar error fails its stream, not the batch)."""
        results: list[int | BaseException] = []
        greedy: list[int] | None = None
        for row, (step, cache, ids) in enumerate(zip(steps, caches, inputs)):
            step.seq.cache = cache
            step.seq.ids.extend(ids)
            try:
                if step.sample is None:
                    results.append(-1)
                elif _plain_greedy(step.sample):
                    if greedy is None:
                        # One argmax (and one device sync) for the whole batch, not one per row.
                        greedy = logits.argmax(dim=-1).tolist()
                    results.append(greedy[row])
                else:
                    results.append(self._sample(logits[row], step.sample))
            except Exception as exc:
                results.append(exc)
        return results

    @staticmethod
    def _sample(logits: torch.Tensor, sample: tuple[Any, int, int, Any]) -> int:
        sampling, seed, position, guide = sample
        generator = None if sampling.temperature == 0 else position_generator(seed, position)
        if guide is not None:
            logits = guide.apply(logits)
        token = select_token(logits, sampling.temperature, sampling.top_p, generator)
        if guide is not None:
            guide.advance(token)
        return token

    def _count_forward(self, seconds: float) -> None:
        self._step_seconds += seconds
        self._forwards += 1

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        if self._slots is None:
            raise Unavailable("torch engine is not started")
        if self._slots.locked() and self._waiting >= self._max_waiting:
            raise ResourceExhausted(
                f"{self._running} running and {self._waiting} waiting; queue is full", retry_after_s=1.0
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._slots.release()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._running,
            waiting=self._waiting,
            kv_tokens=self._kv_tokens,
            kv_capacity_tokens=self._kv_capacity,
            extra={
                "max_concurrency": float(self._max_concurrency),
                "generated_tokens_total": float(self._generated_total),
                "forward_ms_avg": 1000 * self._step_seconds / max(1, self._forwards),
                "decode_batch_avg": self._steps.batched_steps / max(1, self._steps.batches),
                "session_memory_tokens": float(self._sessions.tokens),
            },
        )


def _plain_greedy(sample: tuple[Any, int, int, Any]) -> bool:
    """Argmax with no grammar: the same token as select_token's greedy path (lowest id on ties)."""
    sampling, _seed, _position, guide = sample
    return sampling.temperature <= 0.0 and guide is None


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _config_vocab_size(model_dir: Path) -> int | None:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    size = (config.get("text_config") or config).get("vocab_size")
    return int(size) if size else None


def _replace_eos(description: ModelDescription, eos_ids: Sequence[int]) -> ModelDescription:
    from dataclasses import replace

    return replace(description, eos_token_ids=tuple(int(i) for i in eos_ids))
