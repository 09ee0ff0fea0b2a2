"""What the installed vLLM provides, found once at engine start.

vLLM moved its pieces between releases: the async engine is `vllm.v1.engine.async_llm.AsyncLLM`
in V1 releases (where `AsyncLLMEngine` is an alias of it) and
`vllm.engine.async_llm_engine.AsyncLLMEngine` before; JSON-Schema guidance is
`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))` in recent releases and
`SamplingParams(guided_decoding=GuidedDecodingParams(json=...))` in older ones. `detect_vllm_api`
looks each piece up once and returns a `VllmApi` that the engine uses from then on, so no
other module needs to know which release is installed.

The module importer is a parameter, so detection is tested with stand-in modules and never
needs vLLM itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from services.worker.vllm.errors import VllmErrorTypes

Importer = Callable[[str], Any]


class VllmNotInstalled(ImportError):
    """vLLM is not importable: it comes with the `gpu` extra, on GPU machines only."""


@dataclass(frozen=True)
class VllmApi:
    version: str
    # "AsyncLLM" (V1 engine) or "AsyncLLMEngine" (the engine before V1).
    engine_kind: str
    engine_class: Any
    engine_args_class: Any
    sampling_params_class: Any
    delta_output_kind: Any
    # Builds the prompt object from keyword fields (TokensPrompt is a TypedDict: a dict).
    tokens_prompt_class: Any
    # The SamplingParams field that takes JSON-Schema guidance, and the class it takes;
    # "" / None when this vLLM has no guided decoding.
    structured_field: str
    structured_class: Any
    # Base class of custom stat loggers (V1 only); None where stats cannot be observed.
    stat_logger_base: Any
    # Exceptions that mean the engine process is gone for good.
    dead_errors: tuple[type[BaseException], ...]
    # Exceptions that mean the request is bad (the same on every replica).
    client_errors: tuple[type[BaseException], ...] = ()
    # "cuda" or "cpu" (vLLM's CPU build): where the KV cache lives, whether sleep mode exists.
    platform: str = "cuda"
    # The engine argument class that picks the structured-output backend; None: vLLM's default.
    structured_config_class: Any = None
    # KVTransferConfig (configures a KV connector); None where this vLLM has none.
    kv_transfer_config_class: Any = None
    # On CPUs: vLLM's choice of attention kernel, (dtype, block_size, head_size, kv_cache_dtype)
    # -> "vec", "amx", ...; it decides how keys are packed in a page (`kv_pages`).
    cpu_attention_isa: Callable[..., str] | None = None

    @property
    def error_types(self) -> VllmErrorTypes:
        return VllmErrorTypes(client=self.client_errors, dead=self.dead_errors)

    @property
    def supports_sleep_mode(self) -> bool:
        # vLLM's CPU platform refuses enable_sleep_mode ("not supported on current platform").
        return self.platform != "cpu"

    @property
    def supports_cache_salt(self) -> bool:
        # Only the V1 engine reads `cache_salt` from a prompt; older ones ignore or refuse it.
        return self.engine_kind == "AsyncLLM"

    def sampling_params(self, **kwargs: Any) -> Any:
        return self.sampling_params_class(**kwargs)

    def structured(self, schema: str) -> dict[str, Any]:
        """The SamplingParams keyword argument that guides output by a JSON Schema."""
        if not self.structured_field:
            return {}
        return {self.structured_field: self.structured_class(json=schema)}

    def tokens_prompt(self, token_ids: list[int], cache_salt: str = "") -> Any:
        fields: dict[str, Any] = {"prompt_token_ids": token_ids}
        if cache_salt and self.supports_cache_salt:
            fields["cache_salt"] = cache_salt
        if self.tokens_prompt_class is None:
            return fields
        return self.tokens_prompt_class(**fields)


def _find(importer: Importer, candidates: tuple[tuple[str, str], ...]) -> Any:
    """The first attribute of `candidates` ((module, name) pairs) that imports; None if none."""
    for module, name in candidates:
        try:
            return getattr(importer(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def detect_vllm_api(importer: Importer = importlib.import_module) -> VllmApi:
    """Looks up every piece Ballast uses in the installed vLLM. Raises VllmNotInstalled
    without vLLM, and RuntimeError (naming the version) when a required piece is missing."""
    try:
        vllm = importer("vllm")
    except ImportError as exc:
        raise VllmNotInstalled(
            "worker.engine is 'vllm' but vLLM is not installed: install the gpu extra "
            "(pip install 'ballast[gpu]') on a machine with an NVIDIA GPU"
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))

    engine_class = _find(importer, (("vllm.v1.engine.async_llm", "AsyncLLM"),))
    kind = "AsyncLLM"
    if engine_class is None:
        engine_class = _find(importer, (("vllm.engine.async_llm_engine", "AsyncLLMEngine"), ("vllm", "AsyncLLMEngine")))
        kind = "AsyncLLMEngine"
    if engine_class is None:
        raise RuntimeError(f"vLLM {version} provides neither AsyncLLM nor AsyncLLMEngine")

    args_class = _find(importer, (("vllm.engine.arg_utils", "AsyncEngineArgs"), ("vllm", "AsyncEngineArgs")))
    params_class = _find(importer, (("vllm.sampling_params", "SamplingParams"), ("vllm", "SamplingParams")))
    output_kind = _find(importer, (("vllm.sampling_params", "RequestOutputKind"),))
    missing = [
        name
        for name, value in (
            ("AsyncEngineArgs", args_class),
            ("SamplingParams", params_class),
            ("RequestOutputKind", output_kind),
        )
        if value is None
    ]
    if missing:
        # Without DELTA outputs every step would resend the whole answer so far.
        raise RuntimeError(
            f"vLLM {version} lacks {', '.join(missing)}; Ballast needs a vLLM with RequestOutputKind.DELTA streaming"
        )

    tokens_prompt = _find(importer, (("vllm.inputs", "TokensPrompt"), ("vllm", "TokensPrompt")))
    structured_class = _find(importer, (("vllm.sampling_params", "StructuredOutputsParams"),))
    structured_field = "structured_outputs"
    if structured_class is None:
        structured_class = _find(importer, (("vllm.sampling_params", "GuidedDecodingParams"),))
        structured_field = "guided_decoding" if structured_class is not None else ""

    structured_config = _find(
        importer,
        (("vllm.config.structured_outputs", "StructuredOutputsConfig"), ("vllm.config", "StructuredOutputsConfig")),
    )
    current = _find(importer, (("vllm.platforms", "current_platform"),))
    is_cpu = getattr(current, "is_cpu", None)
    platform = "cpu" if callable(is_cpu) and is_cpu() else "cuda"

    kv_transfer = _find(
        importer, (("vllm.config.kv_transfer", "KVTransferConfig"), ("vllm.config", "KVTransferConfig"))
    )
    cpu_isa = (
        _find(importer, (("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa"),)) if platform == "cpu" else None
    )
    stat_logger_base = None
    if kind == "AsyncLLM":
        stat_logger_base = _find(
            importer, (("vllm.v1.metrics.loggers", "StatLoggerBase"), ("vllm.v1.metrics.base", "StatLoggerBase"))
        )
    dead = [
        cls
        for cls in (
            _find(importer, (("vllm.v1.engine.exceptions", "EngineDeadError"),)),
            _find(importer, (("vllm.engine.async_llm_engine", "AsyncEngineDeadError"),)),
        )
        if isinstance(cls, type)
    ]
    client = [
        cls
        for cls in (
            _find(importer, (("vllm.exceptions", "VLLMClientError"),)),
            _find(importer, (("vllm.exceptions", "VLLMValidationError"),)),
        )
        if isinstance(cls, type)
    ]
    return VllmApi(
        version=version,
        engine_kind=kind,
        engine_class=engine_class,
        engine_args_class=args_class,
        sampling_params_class=params_class,
        delta_output_kind=output_kind.DELTA,
        tokens_prompt_class=tokens_prompt,
        structured_field=structured_field,
        structured_class=structured_class,
        stat_logger_base=stat_logger_base,
        dead_errors=tuple(dead),
        client_errors=tuple(client),
        platform=platform,
        structured_config_class=structured_config,
        kv_transfer_config_class=kv_transfer,
        cpu_attention_isa=cpu_isa,
    )
