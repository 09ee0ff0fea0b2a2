"""BallastKVConnector: session KV between vLLM and Ballast's cache service, through vLLM's
KV-connector interface (`KVConnectorBase_V1`).

vLLM loads this module by path in its engine processes when the worker configures the
connector (`connector_config`); it imports vLLM at module level and is never imported by
the worker itself. One instance runs beside vLLM's scheduler, one beside each model runner:

  * Scheduler side (`SchedulerBook`): for each waiting session request, one Lookup of the
    blocks its context could restore (named by `kv_keys` exactly as the torch engine names
    them, tenant from the worker, never the client); the tokens beyond vLLM's own prefix
    cache that the store holds are reported as loadable. Each step's metadata lists the
    blocks to load into the pages just allocated, and the blocks the step completes.
  * Worker side: before the forward pass, fetch the blocks (checksummed) and scatter them
    into their pages (`kv_pages`); pages of a block that did not arrive or failed its
    checksum are reported through `get_block_ids_with_load_errors`, and vLLM recomputes
    them (`kv_load_failure_policy="recompute"`). After the pass, copy the completed blocks
    out and save them in the background (`StoreLink`).

Nothing here fails a request: with the store down, slow or sending bad bytes, vLLM computes
the prefix itself. Counts of every outcome travel with vLLM's scheduler stats
(`BallastConnectorStats`) to the worker, which reports them as its KV metrics.

Loads are synchronous (done before the first layer runs): a prefix is tens of blocks at most
per request, and layer-by-layer overlap would need the async-load protocol. Pages are
written on the CPU layout only (`kv_pages`: vLLM's CPU "vec" attention); the worker does not
configure the connector elsewhere.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from services.cache.client import PutBlock
from services.cache.types import KVScope
from services.worker.kv.tensors import NAMED_DTYPES
from services.worker.vllm.connector_config import ConnectorSetup, session_tenant
from services.worker.vllm.connector_plan import BlockMove, ScheduledCached, ScheduledNew, SchedulerBook
from services.worker.vllm.kv_keys import ConnectorKeys
from services.worker.vllm.kv_pages import block_from_payload, block_payload, gather_block, scatter_block
from services.worker.vllm.store_link import ConnectorCounters, StoreLink

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class BallastConnectorMeta(KVConnectorMetadata):
    loads: tuple[BlockMove, ...] = ()
    saves: tuple[BlockMove, ...] = ()


@dataclass
class BallastConnectorStats(KVConnectorStats):
    """Outcome counts since the last report ("lookups.hit", "restored_blocks", ...)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "BallastConnectorStats":
        merged = dict(self.data)
        for name, value in (other.data or {}).items():
            merged[name] = merged.get(name, 0) + value
        return BallastConnectorStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _layer_order(name: str) -> int:
    found = _LAYER_INDEX.search(name)
    return int(found.group(1)) if found else 0


class BallastKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.setup = ConnectorSetup.from_extra_config(extra)
        self.keys = ConnectorKeys(
            self.setup.model_version, self.setup.store.block_tokens, int(vllm_config.cache_config.block_size)
        )
        self.counters = ConnectorCounters()
        self.store = StoreLink(self.setup.store, self.counters)
        self.book = SchedulerBook(self.keys)
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a later miss, nothing more

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return BallastConnectorStats(dict(data or {}))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        counts = self.counters.take()
        return BallastConnectorStats(counts) if counts else None

    def _scope(self, tenant: str) -> KVScope:
        return self.keys.scope(tenant)

    # --- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tenant = session_tenant(getattr(request, "kv_transfer_params", None))
        if tenant is None:
            return 0, False
        loadable = self.book.matched(
            request.request_id,
            tenant,
            lambda: request.all_token_ids,
            num_computed_tokens,
            lambda names: self.store.lookup(self._scope(tenant), names),
        )
        return loadable, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.book.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        new = [
            ScheduledNew(r.req_id, r.block_ids[0], r.num_computed_tokens, scheduled.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
            if self.book.tracks(r.req_id)
        ]
        cached_reqs = scheduler_output.scheduled_cached_reqs
        cached = []
        for i, req_id in enumerate(cached_reqs.req_ids):
            if not self.book.tracks(req_id):
                continue
            pages = cached_reqs.new_block_ids[i]
            cached.append(
                ScheduledCached(
                    req_id,
                    pages[0] if pages is not None else None,
                    req_id in cached_reqs.resumed_req_ids,
                    cached_reqs.num_computed_tokens[i],
                    scheduled.get(req_id, 0),
                )
            )
        plan = self.book.plan(new, cached)
        return BallastConnectorMeta(plan.loads, plan.saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.book.finished(request.request_id)
        return False, None  # completed blocks were saved as they filled

    # --- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_order)]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, BallastConnectorMeta)
        for move in meta.loads:
            self._load(move)

    def _load(self, move: BlockMove) -> None:
        layout = self.setup.layout
        started = time.perf_counter()
        fetched = self.store.get(self._scope(move.tenant), list(move.names), layout)
        good = fetched.verified_prefix() if fetched is not None else 0
        if fetched is not None and good < fetched.blocks:
            self.counters.add("restore_failures.checksum")
        dtype = NAMED_DTYPES[layout.dtype]
        head_dim = layout.shape[-1]
        for i, pages in enumerate(move.pages):
            skip = move.skip_pages if i == 0 else 0
            if i < good:
                block = block_from_payload(fetched.payload(i), layout.shape, dtype)  # type: ignore[union-attr]
                scatter_block(block, self._layers, pages, head_dim, skip)
            else:
                self._load_errors.update(pages[skip:])
        self.counters.add("restored_blocks", good)
        if good:
            self.counters.add("restore_ms", (time.perf_counter() - started) * 1000)
            self.counters.add("restores")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # everything was loaded in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # blocks are copied out once the whole step has run (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, BallastConnectorMeta)
        head_dim = self.setup.layout.shape[-1]
        for move in meta.saves:
            blocks = []
            for i, (name, pages) in enumerate(zip(move.names, move.pages)):
                payload, crc = block_payload(gather_block(self._layers, pages, head_dim))
                blocks.append(PutBlock(move.first_block + i, name, payload, crc))
            self.store.put(self._scope(move.tenant), self.setup.layout, blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.store.close()
