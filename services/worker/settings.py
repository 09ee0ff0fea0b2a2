"""The `worker` section of ballast.yaml: one model replica's engine, capacity, KV persistence
and process settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.common.config import Section


class WorkerConfig(Section):
    id: str = Field("", description="Worker id in etcd; empty: host-port-pid.")
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 picks one.")
    advertise_host: str = Field("", description="Address the router dials; empty: host.")
    engine: Literal["torch", "vllm", "sim"] = Field(
        "torch",
        description="Model runtime: torch, vllm, or sim (a timing model without a model, "
        "for measuring the mesh; tokens from the model folder's tokenizer).",
    )
    sim_profile: str = Field(
        "", description="sim engine: a JSON timing profile (deploy/sim/); empty: the built-in default."
    )
    sim_faults: dict = Field(
        default_factory=dict,
        description="sim engine: fault knobs at start (services/worker/sim/faults.py); while it runs, "
        "the etcd key {prefix}sim/faults/{worker id} replaces them.",
    )
    model_dir: str = Field(".ballast/models/tiny", description="Hugging Face model folder.")
    model_name: str = Field("tiny", description="Logical model name clients ask for.")
    pool: str = Field("primary", description="Pool of the model: primary or light.")
    device: str = Field("auto", description="torch device: auto, cpu or cuda.")
    torch_runtime: Literal["auto", "native", "transformers"] = Field(
        "auto",
        description="torch engine: native batched Llama-family decoder, transformers for "
        "any model, or auto (native where it computes the model exactly).",
    )
    max_batch: int = Field(64, ge=1, description="torch engine: decode steps in one forward pass.")
    gil_switch_ms: float = Field(
        1.0,
        gt=0,
        le=100,
        description="Python's thread switch interval in the worker process: how long "
        "the event loop may wait for the compute thread to yield the GIL.",
    )
    relay: bool = Field(
        True,
        description="Serve Worker/Relay and say so in the etcd record: routers then carry all their "
        "requests to this worker over one stream, several requests' tokens to a message. Off: a "
        "Generate call per request.",
    )
    b_tier_flush_ms: float = Field(
        50.0,
        ge=0,
        le=1000,
        description="B-tier streams: tokens leave in one message per this many ms (0: every token as it comes).",
    )
    engine_progress_ms: float = Field(
        500.0,
        ge=0,
        le=10_000,
        description="Relay streams: once per this many ms in which the engine computed steps but none "
        "of a router's requests got a token (a long or queued prefill), the worker tells that router "
        "its engine moved, so a first token's stall on a busy engine is not held against the request "
        "(0: never). Keep it well under the routers' shortest stall timeout.",
    )
    engine_stall_warn_s: float = Field(
        5.0,
        gt=0,
        description="Requests in flight waiting this long or longer for an engine step are logged (at most "
        "one line a minute); the gaps are exported as ballast_worker_engine_step_gap either way.",
    )
    engine_watch_interval_s: float = Field(
        0.25,
        gt=0,
        le=10,
        description="How often the engine's step count is read for ballast_worker_engine_step_gap and "
        "ballast_worker_engine_stalled_ms.",
    )
    max_concurrency: int = Field(8, ge=1, description="Sequences generated at once (capacity).")
    max_queue: int = Field(16, ge=0, description="Requests allowed to wait for a slot.")
    temperature_file: str = Field("", description="File holding a GPU temperature in C, read instead of NVML (tests).")
    drain_grace_s: float = Field(20.0, ge=0, description="Time in-flight streams get on SIGTERM.")
    fault_file: str = Field(
        "", description="Chaos testing: while this file says 'unavailable', Generate fails at once."
    )
    cache_address: str = Field("", description="KV-cache service host:port; empty: no KV persistence.")
    kv_block_tokens: int = Field(32, ge=1, le=4096, description="Tokens per stored KV block.")
    kv_restore_policy: Literal["adaptive", "always", "never"] = Field(
        "adaptive", description="Restore a cached prefix by measured cost, always, or never."
    )
    kv_memory_sessions: int = Field(
        4, ge=0, description="Recent sessions whose KV the engine keeps in memory (0: none)."
    )
    kv_save_queue: int = Field(8, ge=1, description="Pending session saves; more are dropped.")
    kv_timeout_s: float = Field(0.5, gt=0, description="Deadline of a KV lookup or health check.")
    kv_restore_timeout_s: float = Field(5.0, gt=0, description="Longest a KV restore may take.")
    kv_save_timeout_s: float = Field(10.0, gt=0, description="Longest a KV save may take.")
    kv_ttl_s: int = Field(0, ge=0, description="TTL of saved blocks; 0: the cache's default.")
    # vLLM engine (worker.engine = vllm). Checked against the model and the GPU at start.
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="vLLM: share of the GPU's memory for weights, activations and KV."
    )
    kv_cache_dtype: Literal["", "auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"] = Field(
        "", description="vLLM: KV-cache dtype, required and explicit (fp8, or the weights' dtype); 'auto' is refused."
    )
    max_model_len: int = Field(0, ge=0, description="vLLM: longest sequence served; 0: the model's own maximum.")
    enable_chunked_prefill: bool = Field(True, description="vLLM: split long prefills across steps.")
    enable_prefix_caching: bool = Field(True, description="vLLM: reuse KV of shared prompt prefixes.")
    enforce_eager: bool = Field(False, description="vLLM: no CUDA graphs (less memory, slower decode).")
    vllm_cpu_threads_bind: str = Field(
        "auto",
        pattern=r"^(auto|nobind|[0-9,\-|]+)$",
        description="vLLM on CPUs: cores the engine's OpenMP threads run on (VLLM_CPU_OMP_THREADS_BIND): "
        "auto, nobind, or a list like '0-3'. Give engines sharing a host disjoint cores.",
    )
    vllm_cpu_kv_cache_gib: int = Field(
        1,
        ge=1,
        le=1024,
        description="vLLM on CPUs: host memory for the KV cache in GiB, in place of "
        "gpu_memory_utilization (vLLM's VLLM_CPU_KVCACHE_SPACE).",
    )
    sleep_on_standby: bool = Field(
        False,
        description="vLLM on GPUs: start asleep (weights offloaded, KV freed) and wake on the first "
        "request. vLLM's CPU build has no sleep mode: a CPU standby stays loaded.",
    )
    standby: bool = Field(
        False, description="Start as a warm standby: model loaded, registered, not routable until promoted."
    )
    respawn: bool = Field(
        False,
        description="Run under a keeper that has the engine imported and starts a fresh worker "
        "at once when one dies (about 0.5 s instead of a cold start).",
    )
    respawn_max: int = Field(
        10,
        ge=0,
        description="Crashes within respawn_window_s that the keeper reports as a crash loop "
        "(it logs an error and goes on restarting, at the backoff's cap).",
    )
    respawn_window_s: float = Field(60.0, gt=0, description="Window of respawn_max.")
    respawn_backoff_initial_s: float = Field(
        0.5, ge=0, description="Keeper: wait before the first restart after a death; doubles with each death in a row."
    )
    respawn_backoff_max_s: float = Field(30.0, gt=0, description="Keeper: the longest wait before a restart.")
    respawn_healthy_s: float = Field(
        10.0,
        gt=0,
        description="Keeper: a worker that served this long was healthy: its next death waits "
        "the initial backoff again.",
    )
    # A vLLM CPU worker of the bench model holds about 2.9 GB (1 GiB of it KV cache), a torch
    # worker of the tiny model about 0.3 GB: room for a real small model, far below a runaway.
    memory_limit_mb: int = Field(
        6144,
        ge=0,
        description="Resident memory (MB) of the worker and what it starts, over which its keeper "
        "(or the local supervisor) SIGKILLs and restarts it; 0: no limit.",
    )

    @model_validator(mode="after")
    def _backoff_order(self):
        if self.respawn_backoff_max_s < self.respawn_backoff_initial_s:
            raise ValueError("worker.respawn_backoff_max_s must be >= worker.respawn_backoff_initial_s")
        return self

    @field_validator("vllm_cpu_threads_bind", mode="before")
    @classmethod
    def _core_list_as_text(cls, value):
        # A single core ("0") arrives from YAML or the environment as a number.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value
