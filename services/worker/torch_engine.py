"""The torch engine: a Hugging Face causal LM run with transformers, on CPU (or CUDA).

For development, CI and demos, with a real tokenizer and a real KV cache per sequence. All
model compute runs in one dedicated thread, off the event loop. Each request submits its
prefill (in chunks) and then one decode step per token to that thread, so concurrent
sequences interleave step by step and a long prompt does not stall the others. Admission is
bounded: at most `max_concurrency` sequences run, at most `max_waiting` wait for a slot, and
beyond that a request is refused with ResourceExhausted. Closing or cancelling a stream frees
its slot and KV cache at once.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

import torch

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.worker.detokenizer import TextStream
from services.worker.engine import (
    EngineRequest,
    EngineStats,
    FinishReason,
    ModelDescription,
    TokenDelta,
)
from services.worker.model_files import describe_model
from services.worker.sampling import fresh_seed, position_generator, select_token

T = TypeVar("T")


class _Sequence:
    """One running request: its KV cache and how many tokens the cache holds."""

    __slots__ = ("cache", "length")

    def __init__(self) -> None:
        self.cache: Any = None
        self.length = 0


class TorchEngine:
    """`services.worker.engine.Engine` on transformers."""

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
    ) -> None:
        """`max_waiting` bounds the requests queued for a slot (default 4 x concurrency).
        `eos_token_ids` overrides the model's (an empty tuple disables EOS, for benchmarks
        that need fixed-length outputs). `torch_threads` is process-wide in torch."""
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

        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self._dir, local_files_only=True)
        self._vocab_size = _config_vocab_size(self._dir) or len(self._tokenizer)
        self._model: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        self._running = 0
        self._waiting = 0
        self._kv_tokens = 0
        self._generated_total = 0
        self._step_seconds = 0.0
        self._steps = 0

    # --- lifecycle ------------------------------------------------------------------
    @property
    def model(self) -> ModelDescription:
        return self._description

    async def start(self) -> None:
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self._slots = asyncio.Semaphore(self._max_concurrency)
        await self._run(self._load)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if self._device.type == "cpu":
            torch.set_num_threads(self._threads)
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(
            self._dir, dtype=self._dtype, local_files_only=True)
        self._model = model.to(self._device).eval()

    async def stop(self) -> None:
        """Stop taking requests; the step in progress finishes, later steps fail Unavailable."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)
        self._model = None

    # --- requests -------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as is: no BOS added (a rendered chat template carries it)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Validate now (bad input raises InvalidArgument before anything starts), then stream
        one TokenDelta per generated token; the last one carries the finish reason."""
        self._validate(request)
        return self._generate(request)

    def _validate(self, request: EngineRequest) -> None:
        s = request.sampling
        if not request.prompt_ids:
            raise InvalidArgument("prompt is empty")
        bad = [t for t in (*request.prompt_ids, *request.generated_ids)
               if not 0 <= t < self._vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (0..{self._vocab_size - 1})")
        if s.max_tokens < 0:
            raise InvalidArgument("max_tokens must be >= 0")
        total = len(request.prompt_ids) + len(request.generated_ids) + s.max_tokens
        if total > self._description.max_context:
            raise InvalidArgument(
                f"prompt ({len(request.prompt_ids)}) + generated ({len(request.generated_ids)}) "
                f"+ max_tokens ({s.max_tokens}) = {total} tokens exceeds the model's context "
                f"of {self._description.max_context}")
        if not s.temperature >= 0.0:  # also rejects NaN
            raise InvalidArgument("temperature must be >= 0")
        if not 0.0 < s.top_p <= 1.0:
            raise InvalidArgument("top_p must be in (0, 1]")
        if any(not stop for stop in s.stop):
            raise InvalidArgument("stop strings must not be empty")

    async def _generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        s = request.sampling
        text = TextStream(self._tokenizer, s.stop, initial_ids=request.generated_ids)
        if text.stopped:  # the earlier replica already reached a stop string
            yield TokenDelta([], "", FinishReason.STOP)
            return
        if s.max_tokens == 0:  # nothing left to generate: release held-back text
            yield TokenDelta([], text.finish(), FinishReason.LENGTH)
            return
        seed = fresh_seed() if s.seed is None else s.seed
        start_pos = len(request.generated_ids)
        context = [*request.prompt_ids, *request.generated_ids]

        async with self._slot():
            seq = _Sequence()
            try:
                # Prefill in chunks, each its own job, so other sequences step in between.
                for i in range(0, len(context), self._prefill_chunk):
                    chunk = context[i : i + self._prefill_chunk]
                    last = i + self._prefill_chunk >= len(context)
                    token = await self._run(self._forward, seq, chunk,
                                            (s, seed, start_pos) if last else None)
                    self._grow(seq, len(chunk))
                for k in range(s.max_tokens):
                    if k:
                        token = await self._run(self._forward, seq, [token], (s, seed, start_pos + k))
                        self._grow(seq, 1)
                    self._generated_total += 1
                    if token in self._eos:
                        yield TokenDelta([], text.finish(), FinishReason.STOP)
                        return
                    delta, stopped = text.push(token)
                    if stopped:
                        yield TokenDelta([token], delta, FinishReason.STOP)
                        return
                    if k == s.max_tokens - 1:
                        delta += text.finish()
                        reason = FinishReason.STOP if text.stopped else FinishReason.LENGTH
                        yield TokenDelta([token], delta, reason)
                        return
                    yield TokenDelta([token], delta)
            finally:
                # Runs on normal end, aclose() and cancellation alike: the KV goes now.
                self._kv_tokens -= seq.length
                seq.cache, seq.length = None, 0

    def _grow(self, seq: _Sequence, n: int) -> None:
        seq.length += n
        self._kv_tokens += n

    # --- model compute (engine thread only) ----------------------------------------
    def _forward(self, seq: _Sequence, ids: list[int],
                 sample: tuple[Any, int, int] | None) -> int:
        """Run `ids` through the model on top of the sequence's cache; sample the next token
        at generated position `sample[2]` when `sample` is given (else return -1)."""
        started = time.perf_counter()
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=self._device)
            out = self._model(input_ids=x, past_key_values=seq.cache, use_cache=True,
                              logits_to_keep=1)
            seq.cache = out.past_key_values
            token = -1
            if sample is not None:
                sampling, seed, position = sample
                generator = None if sampling.temperature == 0 else position_generator(seed, position)
                token = select_token(out.logits[0, -1], sampling.temperature, sampling.top_p, generator)
        self._step_seconds += time.perf_counter() - started
        self._steps += 1
        return token

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        executor = self._executor
        if executor is None:
            raise Unavailable("torch engine is not running")
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except RuntimeError as exc:
            if "shutdown" in str(exc):
                raise Unavailable("torch engine is stopping") from exc
            raise

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        if self._slots is None:
            raise Unavailable("torch engine is not started")
        if self._slots.locked() and self._waiting >= self._max_waiting:
            raise ResourceExhausted(
                f"{self._running} running and {self._waiting} waiting; queue is full",
                retry_after_s=1.0)
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
                "forward_ms_avg": 1000 * self._step_seconds / max(1, self._steps),
            },
        )


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
