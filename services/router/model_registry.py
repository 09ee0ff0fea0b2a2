"""Tokenizers of the model versions in the membership, fetched once from a worker each."""

from __future__ import annotations

import asyncio

from ballast.v1 import worker_pb2
from services.common.errors import Unavailable
from services.common.membership import WorkerRecord
from services.router.tokenization import ModelTokenizer
from services.router.worker_clients import WorkerChannels

import grpc


class ModelRegistry:
    def __init__(self, clients: WorkerChannels, timeout_s: float, on_new_version=None) -> None:
        self._clients = clients
        # Called with each newly learnt ModelTokenizer (e.g. to evaluate it for metrics).
        self._on_new_version = on_new_version
        self._background: set[asyncio.Task] = set()
        self._timeout_s = timeout_s
        self._by_version: dict[str, ModelTokenizer] = {}
        # The last tokenizer learnt per logical model: it still counts prompts (and says the
        # model's context) after every worker of the model is gone.
        self._latest: dict[str, ModelTokenizer] = {}
        self._pending: dict[str, asyncio.Future[ModelTokenizer]] = {}

    def cached(self, model_version: str) -> ModelTokenizer | None:
        return self._by_version.get(model_version)

    def latest(self, model: str) -> ModelTokenizer | None:
        """The tokenizer last learnt for a logical model, or None if none ever was."""
        return self._latest.get(model)

    async def tokenizer_for(self, worker: WorkerRecord, timeout_s: float) -> ModelTokenizer:
        cached = self._by_version.get(worker.model_version)
        if cached is not None:
            return cached
        pending = self._pending.get(worker.model_version)
        if pending is None:
            # One fetch per version, however many requests arrive meanwhile.
            pending = asyncio.ensure_future(self._fetch(worker, min(timeout_s, self._timeout_s)))
            self._pending[worker.model_version] = pending
            pending.add_done_callback(lambda _f, v=worker.model_version: self._pending.pop(v, None))
        return await asyncio.shield(pending)

    async def _fetch(self, worker: WorkerRecord, timeout_s: float) -> ModelTokenizer:
        try:
            info = await self._clients.stub(worker.address).GetModelInfo(
                worker_pb2.ModelInfoRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"cannot read model info from worker {worker.id}: {exc.code().name}") from None
        tokenizer = await asyncio.to_thread(ModelTokenizer.from_model_info, info)
        self._by_version[info.model_version] = tokenizer
        self._latest[worker.model] = tokenizer
        if self._on_new_version is not None:
            task = asyncio.create_task(self._on_new_version(tokenizer))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return tokenizer
