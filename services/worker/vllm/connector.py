"""A vLLM KV connector for Ballast's cache service: a skeleton, deliberately not wired.

vLLM lets an external store provide and receive KV through a KV connector
(`KVConnectorBase_V1`), configured with `kv_transfer_config`. `build_connector_class`
returns such a class for Ballast's store, keyed exactly like the torch engine's blocks
(`kv_keys`), so sessions could move between torch and vLLM workers of one model version.

What is real: the configuration it reads (model version, stored block size, cache address),
the check that stored blocks are whole vLLM pages, block names per request (tenant from the
request's `cache_salt`), how many tokens a lookup can provide beyond vLLM's own prefix cache,
which pages hold which stored block, and the gather/scatter between vLLM's paged KV and the
stored layout (tested on CPU against the torch engine's encoder).

What remains, each a hook below that raises NotImplementedError rather than pretend:
  1. get_num_new_matched_tokens: a Lookup on the cache service from the scheduler (engine
     core process, synchronous, called repeatedly per request, so cached per request id and
     bounded by worker.kv_timeout_s; or return None and look up asynchronously).
  2. update_state_after_alloc / build_connector_meta: record, per request, the pages vLLM
     allocated for the loaded tokens and the block names to fetch, and pass them to the
     worker side in the step's metadata; also the blocks to save for finished requests.
  3. start_load_kv / wait_for_layer_load: fetch the blocks (Get, checksummed; a bad block
     ends the usable prefix), `scatter_block` them into the paged KV before the layers run,
     and report pages whose load failed through get_block_ids_with_load_errors so vLLM
     recomputes them.
  4. save_kv_layer / wait_for_save / request_finished: after a turn, `gather_block` the
     session's full blocks (skipping those the store has) and Put them in the background,
     holding the pages (request_finished returns True) until get_finished reports the save.
  5. Preemption, CUDA graphs (layer hooks need piecewise graphs) and tensor parallelism
     (each rank holds a slice of the KV heads: a stored block would need all of them).
Until these exist, VllmEngine never configures a connector: on the vLLM path a session's
KV lives in vLLM's prefix cache on this GPU only, and a failover recomputes the prefix.
"""

from __future__ import annotations

from typing import Any

from services.worker.vllm.kv_keys import ConnectorKeys

REMAINING = (
    "Ballast's vLLM KV connector is a skeleton: {hook} is not implemented (see "
    "services/worker/vllm/connector.py for what remains); do not configure it")


def connector_keys(extra_config: dict[str, Any], page_tokens: int) -> ConnectorKeys:
    """The keys from `kv_connector_extra_config` ({"model_version", "block_tokens"}) and
    vLLM's block_size."""
    try:
        version = str(extra_config["model_version"])
        block_tokens = int(extra_config["block_tokens"])
    except KeyError as exc:
        raise ValueError(f"kv_connector_extra_config needs {exc.args[0]!r}") from None
    return ConnectorKeys(version, block_tokens, page_tokens)


def build_connector_class() -> type:
    """The connector class; imports vLLM (GPU machines only)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class BallastKVConnector(KVConnectorBase_V1):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, role: Any, *args: Any) -> None:
            # The base signature grew a kv_cache_config argument across releases.
            super().__init__(vllm_config, role, *args)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            self.keys = connector_keys(extra, int(vllm_config.cache_config.block_size))
            self.cache_address = str(extra.get("cache_address", ""))

        def request_names(self, request: Any) -> list[bytes]:
            """Stored-block names for a vLLM Request's context (tenant = its cache_salt)."""
            tenant = getattr(request, "cache_salt", None) or ""
            return self.keys.lookup_names(tenant, list(request.all_token_ids))

        # --- scheduler side ---------------------------------------------------------
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            raise NotImplementedError(REMAINING.format(hook="get_num_new_matched_tokens (1)"))

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            raise NotImplementedError(REMAINING.format(hook="update_state_after_alloc (2)"))

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            raise NotImplementedError(REMAINING.format(hook="build_connector_meta (2)"))

        def request_finished(self, request: Any, block_ids: Any) -> Any:
            raise NotImplementedError(REMAINING.format(hook="request_finished (4)"))

        # --- worker side ------------------------------------------------------------
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            raise NotImplementedError(REMAINING.format(hook="start_load_kv (3)"))

        def wait_for_layer_load(self, layer_name: str) -> None:
            raise NotImplementedError(REMAINING.format(hook="wait_for_layer_load (3)"))

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            raise NotImplementedError(REMAINING.format(hook="save_kv_layer (4)"))

        def wait_for_save(self) -> None:
            raise NotImplementedError(REMAINING.format(hook="wait_for_save (4)"))

    return BallastKVConnector
