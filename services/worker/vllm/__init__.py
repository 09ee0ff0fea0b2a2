"""The vLLM engine: `services.worker.engine.Engine` over vLLM's async engine, on a GPU.

Modules:
  api          finds what the installed vLLM provides (AsyncLLM or AsyncLLMEngine, output
               kinds, structured-output params), once, without vLLM in the tests
  checks       the memory lessons as explicit configuration, checked at start (pure)
  params       EngineRequest -> SamplingParams keyword arguments, request validation (pure)
  errors       vLLM exceptions -> Ballast typed errors (pure)
  stats        vLLM scheduler stats -> EngineStats, through a stat logger
  engine       VllmEngine itself
  kv_keys      session KV: block names and block layout shared with the torch engine
  connector    the vLLM KV-connector skeleton over kv_keys (not wired; see its docstring)

Nothing here imports vLLM at module level: vLLM comes with the `gpu` extra only, and
everything except opening a real engine is tested without it.
"""

from services.worker.vllm.api import VllmApi, VllmNotInstalled, detect_vllm_api
from services.worker.vllm.checks import (
    EngineConfigError,
    EnginePlan,
    ModelFacts,
    VllmSettings,
    check_engine_config,
    read_model_facts,
)
from services.worker.vllm.engine import VllmEngine

__all__ = [
    "EngineConfigError",
    "EnginePlan",
    "ModelFacts",
    "VllmApi",
    "VllmEngine",
    "VllmNotInstalled",
    "VllmSettings",
    "check_engine_config",
    "detect_vllm_api",
    "read_model_facts",
]
