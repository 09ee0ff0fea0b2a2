"""What Ballast's vLLM KV connector is told, and how a request asks for it. Pure: no vLLM.

The worker starts vLLM with `kv_transfer_config` naming `BallastKVConnector` (loaded by
module path inside vLLM's engine processes) and `extra_config` below: the cache address,
the model version and stored layout that name and shape blocks exactly as the torch engine
does, and the deadlines of `worker.kv_*`. A request takes part only when the worker marks it
(`session_params`): a session request, with the tenant the worker authenticated, never
anything a client sent.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from services.cache.types import KVLayout
from services.common.tls.settings import TLSConfig

CONNECTOR_CLASS = "BallastKVConnector"
CONNECTOR_MODULE = "services.worker.vllm.connector"
# vLLM hands `SamplingParams.extra_args["kv_transfer_params"]` to the connector as
# `request.kv_transfer_params`.
TRANSFER_PARAMS = "kv_transfer_params"
SESSION_KEY = "ballast_session"


@dataclass(frozen=True)
class StoreSettings:
    """The cache service and the deadlines the connector works to (worker.kv_*)."""

    address: str
    block_tokens: int = 32
    timeout_s: float = 0.5  # one lookup
    restore_timeout_s: float = 5.0  # fetching a prefix
    save_timeout_s: float = 10.0  # writing one step's blocks
    ttl_s: int = 0
    save_queue: int = 8  # saves in flight before new ones are dropped
    retry_after_s: float = 1.0  # after a failed call, recompute this long before asking again
    # The worker's TLS files (tls.*), empty when TLS is off: the engine processes dial the
    # cache with the worker's own certificate.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_worker_config(cls, worker: Any, tls: Any = None) -> "StoreSettings":
        files = {}
        if tls is not None and tls.enabled:
            files = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}
        return cls(
            address=worker.cache_address,
            block_tokens=worker.kv_block_tokens,
            timeout_s=worker.kv_timeout_s,
            restore_timeout_s=worker.kv_restore_timeout_s,
            save_timeout_s=worker.kv_save_timeout_s,
            ttl_s=worker.kv_ttl_s,
            save_queue=worker.kv_save_queue,
            **files,
        )

    def tls(self) -> TLSConfig | None:
        if not self.ca_file:
            return None
        return TLSConfig(enabled=True, ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file)


@dataclass(frozen=True)
class ConnectorSetup:
    """Everything the connector needs, as it travels in `kv_connector_extra_config`."""

    store: StoreSettings
    model_version: str
    layout: KVLayout

    def extra_config(self) -> dict[str, Any]:
        return {"store": asdict(self.store), "model_version": self.model_version, "layout": self.layout.to_dict()}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorSetup":
        try:
            return cls(
                StoreSettings(**extra["store"]), str(extra["model_version"]), KVLayout.from_dict(extra["layout"])
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"kv_connector_extra_config is not Ballast's: {exc}") from None


def session_params(tenant: str) -> dict[str, Any]:
    """extra_args entries that let the connector restore and save this request's KV."""
    return {TRANSFER_PARAMS: {SESSION_KEY: {"tenant": tenant}}}


def session_tenant(kv_transfer_params: Any) -> str | None:
    """The tenant of a request the worker marked as a session; None for any other."""
    if not isinstance(kv_transfer_params, dict):
        return None
    marked = kv_transfer_params.get(SESSION_KEY)
    if not isinstance(marked, dict) or not isinstance(marked.get("tenant"), str):
        return None
    return marked["tenant"]


# vLLM's CPU "vec" attention kernels need pages of a multiple of this many tokens.
CPU_PAGE_MULTIPLE = 32


def plan_connector(
    store: StoreSettings | None, model_version: str, facts: Any, plan: Any, platform: str, cpu_attention_isa: Any
) -> tuple[ConnectorSetup | None, str]:
    """The connector to configure, or None and why not (logged, and reported with every
    session request as the reason its prefix is recomputed). `facts`: checks.ModelFacts,
    `plan`: checks.EnginePlan, `cpu_attention_isa`: VllmApi.cpu_attention_isa."""
    from services.worker.vllm.kv_keys import stored_layout
    from services.worker.vllm.kv_pages import VEC_ISA

    if store is None or not store.address:
        return None, "no_cache"
    layout = stored_layout(facts, plan.kv_cache_dtype, store.block_tokens)
    if layout is None:
        return None, "unstorable_model"
    if platform != "cpu":
        # Ballast writes pages in the layout it has checked against vLLM's kernels, and on
        # GPUs none has been checked yet: sessions recompute there rather than risk it.
        return None, "unverified_page_layout"
    if store.block_tokens % CPU_PAGE_MULTIPLE:
        return None, "block_tokens_not_multiple_of_32"
    if cpu_attention_isa is None:
        return None, "unverified_page_layout"
    from services.worker.kv.tensors import NAMED_DTYPES

    isa = cpu_attention_isa(NAMED_DTYPES[layout.dtype], store.block_tokens, facts.head_dim, plan.vllm_kv_cache_dtype)
    if isa != VEC_ISA:
        return None, "unverified_page_layout"
    return ConnectorSetup(store, model_version, layout), ""
