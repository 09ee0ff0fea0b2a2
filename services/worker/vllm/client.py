"""The client side of vLLM: the engine arguments Ballast starts vLLM with (every setting
that decides memory explicit, the KV connector where it applies), the engine client the
engine talks to (`VllmClient`, over a real AsyncLLM), and starting it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from services.worker.vllm.api import VllmApi
from services.worker.vllm.checks import EnginePlan, VllmSettings
from services.worker.vllm.connector_config import CONNECTOR_CLASS, CONNECTOR_MODULE, ConnectorSetup
from services.worker.vllm.request_args import PROCESSOR_NAMES
from services.worker.vllm.stats import SchedulerSnapshot, SchedulerStatsSink


class VllmClient(Protocol):
    """What the engine uses of vLLM's engine client (AsyncLLM), plus its stats."""

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, priority: int = 0) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self) -> None: ...

    @property
    def errored(self) -> bool: ...

    def scheduler_stats(self) -> SchedulerSnapshot | None: ...

    def engine_steps(self) -> int: ...

    def kv_capacity_tokens(self) -> int | None: ...

    def kv_block_tokens(self) -> int | None: ...

    def shutdown(self) -> None: ...


ClientFactory = Callable[[VllmApi, Path, str, VllmSettings, EnginePlan], "VllmClient | Awaitable[VllmClient]"]


def engine_args(
    model_dir: Path, model_name: str, settings: VllmSettings, plan: EnginePlan, api: VllmApi | None = None
) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments: every setting that decides memory is explicit."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "served_model_name": model_name,
        "dtype": plan.dtype,
        "kv_cache_dtype": plan.vllm_kv_cache_dtype,
        "max_model_len": plan.max_model_len,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enforce_eager": settings.enforce_eager,
        "enable_sleep_mode": settings.sleep_on_standby and (api is None or api.supports_sleep_mode),
        "max_num_seqs": settings.max_concurrency,
        # Requests waiting for one of those sequences are admitted by tier (S first), not in
        # arrival order: a worker that holds more than it runs (several routers filling it
        # at once) still starts S before B.
        "scheduling_policy": "priority",
        # Scheduler stats reach our stat logger only while stats are on.
        "disable_log_stats": False,
        "trust_remote_code": False,
        # Position-seeded sampling and resumed guidance (`processors`), loaded by name in
        # vLLM's engine process.
        "logits_processors": list(PROCESSOR_NAMES),
    }
    if plan.platform == "cpu":
        # On CPUs the KV cache is an explicit amount of host memory; a share of memory
        # (gpu_memory_utilization) would mean a share of the whole machine's RAM.
        args["kv_cache_memory_bytes"] = plan.kv_budget_bytes
    else:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    setup: ConnectorSetup | None = plan.connector
    if setup is not None and api is not None:
        # A page is a stored block, so a block never straddles pages of two requests.
        args["block_size"] = setup.store.block_tokens
        args["kv_transfer_config"] = api.kv_transfer_config_class(
            kv_connector=CONNECTOR_CLASS,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=setup.extra_config(),
        )
    if api is not None and api.structured_config_class is not None:
        # llguidance with compact JSON: the grammar Ballast's own guide (resumed streams, the
        # torch engine) uses, so a stream guided here and resumed elsewhere stays consistent.
        args["structured_outputs_config"] = api.structured_config_class(backend="guidance", disable_any_whitespace=True)
    return args


class AsyncLLMClient:
    """`VllmClient` over a real AsyncLLM (or AsyncLLMEngine)."""

    def __init__(self, engine: Any, sink: SchedulerStatsSink) -> None:
        self._engine = engine
        self._sink = sink

    def watch_connector(self, callback: Callable[[dict[str, float]], None]) -> None:
        """Calls `callback` with the KV connector's counts each time vLLM reports them."""
        self._sink.connector_callback = callback

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, priority: int = 0) -> AsyncIterator[Any]:
        return self._engine.generate(prompt, sampling_params, request_id, priority=priority)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def sleep(self, level: int) -> None:
        await self._engine.sleep(level)

    async def wake_up(self) -> None:
        await self._engine.wake_up()

    @property
    def errored(self) -> bool:
        return bool(getattr(self._engine, "errored", False))

    def scheduler_stats(self) -> SchedulerSnapshot | None:
        return self._sink.latest

    def engine_steps(self) -> int:
        return self._sink.steps

    def _cache_config(self) -> Any:
        # Filled in by the engine core after profiling: how many KV blocks it allocated.
        return getattr(getattr(self._engine, "vllm_config", None), "cache_config", None)

    def kv_capacity_tokens(self) -> int | None:
        # One of the blocks is vLLM's reserved null block, never given to a request.
        cache = self._cache_config()
        blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
        return (int(blocks) - 1) * int(size) if blocks and size else None

    def kv_block_tokens(self) -> int | None:
        size = getattr(self._cache_config(), "block_size", None)
        return int(size) if size else None

    def shutdown(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


def open_vllm_client(
    api: VllmApi, model_dir: Path, model_name: str, settings: VllmSettings, plan: EnginePlan
) -> AsyncLLMClient:
    """Starts vLLM (loads the model, profiles memory, allocates the KV cache: minutes).
    Runs on the event loop, as vLLM's own server does: AsyncLLM binds to the running loop."""
    sink = SchedulerStatsSink()
    # Ballast's logits processors implement vLLM's V1 model-runner interface: never let the
    # choice of runner depend on what else is installed (a Triton build, say).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if plan.platform == "cpu":
        # vLLM's engine process reads its core binding from the environment it inherits.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_threads_bind
    args = api.engine_args_class(**engine_args(model_dir, model_name, settings, plan, api))
    kwargs: dict[str, Any] = {}
    if api.stat_logger_base is not None:
        kwargs["stat_loggers"] = [sink.logger_class(api.stat_logger_base)]
    engine = api.engine_class.from_engine_args(args, **kwargs)
    return AsyncLLMClient(engine, sink)
