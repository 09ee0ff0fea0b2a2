"""The memory lessons as explicit configuration, checked before vLLM starts (GPU and CPU).

What went wrong before, and the rule that keeps it from happening again:
  * A KV cache left on `auto` followed whatever dtype the engine picked, and in one
    configuration that was wider than the weights: twice the KV memory for no accuracy.
    So the KV dtype is always explicit, `auto` is refused, and a KV dtype wider than the
    weights (or a 16-bit format other than the weights') is refused too.
  * A max_model_len that could not fit in the KV memory left after the weights was only
    found out deep inside engine start, or as preemption storms under load. So
    max_model_len is checked against the model's own maximum (config.json) and against
    the KV memory the GPU has for it, and start fails at once with the numbers.
  * Long prompts stalled every other stream while they were prefilled in one step: chunked
    prefill is on by default, and prefix caching too.

On CPUs (vLLM's CPU build) the KV cache lives in host memory of an explicit size
(`cpu_kv_cache_bytes`, vLLM's VLLM_CPU_KVCACHE_SPACE) in place of a share of GPU memory, and
the CPU attention kernels take only some head sizes (`CPU_ATTENTION_HEAD_DIMS`): vLLM itself
finds an unsupported one only at the first forward pass, and its engine dies there, so the
check refuses it at start with the model's numbers.

Everything here is pure (config.json facts, settings and a GPU size in; a plan or an
EngineConfigError with the numbers out) so it is tested without vLLM or a GPU.

KV bytes per token = 2 (keys and values) x layers x KV heads x head dim x dtype bytes; for
multi-head latent attention (DeepSeek's MLA) one latent of kv_lora_rank + qk_rope_head_dim
per layer instead. KV memory = GPU memory x gpu_memory_utilization - weights - reserve. vLLM
measures its own activation peak at start and may find less room than this estimate: the
check catches what can never fit, vLLM still refuses what does not fit after profiling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.worker.model_files import max_context

GIB = 1 << 30

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
WEIGHT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, **WEIGHT_DTYPE_BYTES}
# Head sizes vLLM 0.32's CPU attention kernels take (CPUAttentionBackend.get_supported_head_sizes).
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class EngineConfigError(ValueError):
    """The vLLM configuration cannot work on this model and GPU; the message has the numbers."""


@dataclass(frozen=True)
class VllmSettings:
    """How the vLLM engine runs. `from_worker_config` reads the worker's config section."""

    kv_cache_dtype: str = ""
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0  # 0: the model's own maximum
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    sleep_on_standby: bool = False
    sleep_level: int = 1  # 1: weights to CPU memory, KV dropped (fast wake); 2: both dropped
    max_concurrency: int = 8  # vLLM's max_num_seqs
    max_waiting: int | None = None  # requests queued beyond max_concurrency; None: 4 x concurrency
    dtype: str = ""  # the dtype weights run in; "": the checkpoint's own
    reserve_bytes: int = 0  # GPU memory to assume for activations and CUDA graphs
    cpu_kv_cache_bytes: int = 1 * GIB  # on CPUs: host memory for the KV cache
    cpu_threads_bind: str = "auto"  # on CPUs: cores for vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)
    # Session KV persistence through the cache service (connector_config.StoreSettings);
    # None: worker.cache_address unset or worker.kv_restore_policy "never".
    store: Any = None

    @classmethod
    def from_worker_config(cls, worker: Any, tls: Any = None) -> "VllmSettings":
        return cls(
            kv_cache_dtype=worker.kv_cache_dtype,
            gpu_memory_utilization=worker.gpu_memory_utilization,
            max_model_len=worker.max_model_len,
            enable_chunked_prefill=worker.enable_chunked_prefill,
            enable_prefix_caching=worker.enable_prefix_caching,
            enforce_eager=worker.enforce_eager,
            sleep_on_standby=worker.sleep_on_standby,
            max_concurrency=worker.max_concurrency,
            max_waiting=worker.max_queue,
            cpu_kv_cache_bytes=int(worker.vllm_cpu_kv_cache_gib * GIB),
            cpu_threads_bind=worker.vllm_cpu_threads_bind,
            store=_store_settings(worker, tls),
        )


def _store_settings(worker: Any, tls: Any) -> Any:
    if not worker.cache_address or worker.kv_restore_policy == "never":
        return None
    from services.worker.vllm.connector_config import StoreSettings

    return StoreSettings.from_worker_config(worker, tls)


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need from a model folder (config.json and the weight files)."""

    max_position_embeddings: int
    layers: int
    kv_heads: int
    head_dim: int
    weights_dtype: str  # normalised ("bfloat16", "float16", "float32"); "" when unnamed
    weights_bytes: int
    vocab_size: int = 0
    mla_latent_dim: int = 0  # kv_lora_rank + qk_rope_head_dim for MLA models, else 0
    full_attention_only: bool = True  # False with sliding-window or recurrent layers

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        size = KV_DTYPE_BYTES[kv_dtype]
        if self.mla_latent_dim:
            return self.layers * self.mla_latent_dim * size
        return 2 * self.layers * self.kv_heads * self.head_dim * size


@dataclass(frozen=True)
class EnginePlan:
    """The checked configuration that vLLM is started with."""

    dtype: str  # the dtype weights run in, passed to vLLM explicitly
    kv_cache_dtype: str  # as configured
    vllm_kv_cache_dtype: str  # what vLLM is given (see `vllm_kv_dtype`)
    max_model_len: int
    kv_bytes_per_token: int
    gpu_memory_bytes: int | None  # None: unknown, the memory checks were skipped
    kv_budget_bytes: int | None
    kv_capacity_tokens: int | None
    platform: str = "cuda"  # "cuda" or "cpu" (vLLM's CPU build: KV in host memory)
    # Session KV through the cache service (connector_config.ConnectorSetup); None: off.
    connector: Any = None


def normalise_dtype(name: Any) -> str:
    return _DTYPE_ALIASES.get(str(name or "").lower().removeprefix("torch."), "")


def read_model_facts(model_dir: Path) -> ModelFacts:
    """Reads config.json and the weight files' sizes; never loads weights."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    mla = 0
    if text.get("kv_lora_rank"):
        mla = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
    layer_types = text.get("layer_types") or []
    # Qwen2-style configs name a window but switch it off with use_sliding_window.
    sliding = bool(text["use_sliding_window"]) if "use_sliding_window" in text else bool(text.get("sliding_window"))
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    return ModelFacts(
        max_position_embeddings=max_context(config),
        layers=int(text["num_hidden_layers"]),
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        weights_dtype=normalise_dtype(dtype),
        weights_bytes=weights_bytes(model_dir),
        vocab_size=int(text.get("vocab_size") or 0),
        mla_latent_dim=mla,
        full_attention_only=not sliding and all(t == "full_attention" for t in layer_types),
    )


def weights_bytes(model_dir: Path) -> int:
    """Bytes of the weight files vLLM loads: *.safetensors when present (vLLM prefers them
    and repositories often ship *.bin copies beside them), else *.bin."""
    files = [p for p in Path(model_dir).iterdir() if p.is_file()]
    chosen = [p for p in files if p.suffix == ".safetensors"] or [p for p in files if p.suffix == ".bin"]
    return sum(p.stat().st_size for p in chosen)


def vllm_kv_dtype(kv_dtype: str, weights_dtype: str) -> str:
    """The kv_cache_dtype string vLLM is given. A KV dtype equal to the weights' is passed as
    vLLM's `auto` together with that explicit model dtype: `auto` then means exactly that
    dtype, and it works on every vLLM release (some accept no "float16"/"float32" here)."""
    return "auto" if kv_dtype == weights_dtype else kv_dtype


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _checked_dtypes(settings: VllmSettings, facts: ModelFacts) -> tuple[str, str]:
    """(the dtype weights run in, the KV dtype), or EngineConfigError."""
    checkpoint = facts.weights_dtype
    dtype = normalise_dtype(settings.dtype) if settings.dtype else checkpoint
    if settings.dtype and not dtype:
        raise EngineConfigError(f"dtype {settings.dtype!r} is not one of bfloat16, float16, float32")
    if not dtype:
        raise EngineConfigError(
            "config.json names no torch_dtype, so the weights' dtype is unknown and the KV dtype "
            "cannot be checked against it; add torch_dtype to config.json"
        )
    weights_width = WEIGHT_DTYPE_BYTES[dtype]

    kv = settings.kv_cache_dtype
    if kv in ("", "auto"):
        said = "'auto'" if kv == "auto" else "unset"
        raise EngineConfigError(
            f"worker.kv_cache_dtype is {said}: it must be explicit, because 'auto' follows whatever "
            f"dtype the engine picks and can end up wider than the weights. Set it to match the "
            f"weights ({dtype}), or fp8 to halve KV memory"
        )
    if kv not in KV_DTYPE_BYTES:
        raise EngineConfigError(f"worker.kv_cache_dtype {kv!r} is not one of {sorted(KV_DTYPE_BYTES)}")
    kv_width = KV_DTYPE_BYTES[kv]
    if kv_width > weights_width:
        raise EngineConfigError(
            f"worker.kv_cache_dtype {kv} ({kv_width} bytes) is wider than the weights ({dtype}, "
            f"{weights_width} bytes): it multiplies KV memory by {kv_width // weights_width} for no "
            f"accuracy; set {dtype} or fp8"
        )
    if kv_width == weights_width == 2 and kv != dtype:
        raise EngineConfigError(
            f"worker.kv_cache_dtype {kv} does not match the weights ({dtype}): the two 16-bit "
            f"formats have different ranges, so keys and values would be rounded or overflow; "
            f"set {dtype} or fp8"
        )
    return dtype, kv


def _checked_max_len(settings: VllmSettings, facts: ModelFacts) -> int:
    model_max = facts.max_position_embeddings
    max_len = settings.max_model_len or model_max
    if max_len > model_max:
        raise EngineConfigError(
            f"worker.max_model_len {max_len} exceeds the model's own maximum of {model_max} "
            f"(config.json); set at most {model_max}, or 0 for the model's own"
        )
    return max_len


def _kv_bytes_per_token(facts: ModelFacts, kv: str) -> int:
    per_token = facts.kv_bytes_per_token(kv)
    if per_token <= 0:
        raise EngineConfigError(
            f"config.json gives {facts.layers} layers, {facts.kv_heads} KV heads, head dim "
            f"{facts.head_dim}: no KV size can be computed"
        )
    return per_token


def check_engine_config(settings: VllmSettings, facts: ModelFacts, gpu_memory_bytes: int | None) -> EnginePlan:
    """The plan vLLM starts with, or EngineConfigError explaining (with numbers) what cannot
    work. `gpu_memory_bytes` is the GPU's total memory; None skips the memory checks."""
    dtype, kv = _checked_dtypes(settings, facts)
    checkpoint = facts.weights_dtype
    weights_width = WEIGHT_DTYPE_BYTES[dtype]

    if not 0.0 < settings.gpu_memory_utilization <= 1.0:
        raise EngineConfigError(f"worker.gpu_memory_utilization {settings.gpu_memory_utilization} must be in (0, 1]")

    max_len = _checked_max_len(settings, facts)

    per_token = _kv_bytes_per_token(facts, kv)
    budget = capacity = None
    if gpu_memory_bytes:
        weights = facts.weights_bytes
        if checkpoint and dtype != checkpoint:
            # Weights are cast on load: their memory scales with the dtype they run in.
            weights = weights * weights_width // WEIGHT_DTYPE_BYTES[checkpoint]
        usable = int(gpu_memory_bytes * settings.gpu_memory_utilization)
        budget = usable - weights - settings.reserve_bytes
        if budget <= 0:
            raise EngineConfigError(
                f"the weights need {_gib(weights)} ({dtype}) plus a reserve of "
                f"{_gib(settings.reserve_bytes)}, but worker.gpu_memory_utilization "
                f"{settings.gpu_memory_utilization} of this GPU's {_gib(gpu_memory_bytes)} is "
                f"{_gib(usable)}: nothing is left for the KV cache"
            )
        need = max_len * per_token
        if need > budget:
            fits = budget // per_token
            raise EngineConfigError(
                f"max_model_len {max_len} needs {max_len} x {per_token} bytes per token "
                f"({kv} KV, {facts.layers} layers) = {_gib(need)} of KV cache for one sequence, but "
                f"only {_gib(budget)} is left for KV ({_gib(gpu_memory_bytes)} x "
                f"{settings.gpu_memory_utilization} - weights {_gib(weights)} - reserve "
                f"{_gib(settings.reserve_bytes)}); set worker.max_model_len to at most {fits}, "
                f"use kv_cache_dtype fp8, or raise worker.gpu_memory_utilization"
            )
        capacity = budget // per_token
    return EnginePlan(
        dtype=dtype,
        kv_cache_dtype=kv,
        vllm_kv_cache_dtype=vllm_kv_dtype(kv, dtype),
        max_model_len=max_len,
        kv_bytes_per_token=per_token,
        gpu_memory_bytes=gpu_memory_bytes,
        kv_budget_bytes=budget,
        kv_capacity_tokens=capacity,
    )


def check_cpu_engine_config(settings: VllmSettings, facts: ModelFacts) -> EnginePlan:
    """The plan vLLM's CPU build starts with, or EngineConfigError with the numbers: the same
    dtype rules as on a GPU, a head size the CPU kernels take, and a KV cache of
    `cpu_kv_cache_bytes` that holds at least one sequence of max_model_len."""
    dtype, kv = _checked_dtypes(settings, facts)
    if kv != dtype and KV_DTYPE_BYTES[kv] != 1:
        # CPU attention stores KV in the weights' dtype or in fp8, nothing else.
        raise EngineConfigError(
            f"worker.kv_cache_dtype {kv} differs from the weights ({dtype}); vLLM on CPU keeps the KV "
            f"cache in the weights' dtype or fp8: set {dtype}"
        )
    if not facts.mla_latent_dim and facts.head_dim not in CPU_ATTENTION_HEAD_DIMS:
        raise EngineConfigError(
            f"the model's head dim is {facts.head_dim} (hidden size / attention heads in config.json); "
            f"vLLM's CPU attention takes only {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))} and would "
            f"fail at the first forward pass"
        )
    max_len = _checked_max_len(settings, facts)
    per_token = _kv_bytes_per_token(facts, kv)
    budget = settings.cpu_kv_cache_bytes
    if budget < GIB:
        # vLLM reads its CPU KV space in whole GiB (VLLM_CPU_KVCACHE_SPACE).
        raise EngineConfigError(f"worker.vllm_cpu_kv_cache_gib must be at least 1 (got {_gib(budget)})")
    need = max_len * per_token
    if need > budget:
        raise EngineConfigError(
            f"max_model_len {max_len} needs {max_len} x {per_token} bytes per token = {_gib(need)} of KV "
            f"cache for one sequence, but worker.vllm_cpu_kv_cache_gib gives {_gib(budget)}; set "
            f"worker.max_model_len to at most {budget // per_token} or give the KV cache more memory"
        )
    return EnginePlan(
        dtype=dtype,
        kv_cache_dtype=kv,
        vllm_kv_cache_dtype=vllm_kv_dtype(kv, dtype),
        max_model_len=max_len,
        kv_bytes_per_token=per_token,
        gpu_memory_bytes=None,
        kv_budget_bytes=budget,
        kv_capacity_tokens=budget // per_token,
        platform="cpu",
    )


def gpu_memory_bytes(device_index: int = 0) -> int | None:
    """Total memory of the GPU, from NVML (or torch's CUDA runtime); None without a GPU."""
    try:
        import pynvml  # nvidia-ml-py, in the gpu extra

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no package, no driver or no GPU: try the CUDA runtime instead
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(device_index).total_memory)
    except Exception:  # a broken CUDA install must not hide the real error vLLM will give
        pass
    return None
