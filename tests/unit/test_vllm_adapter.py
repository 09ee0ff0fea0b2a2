"""The vLLM engine adapter against a stand-in for vLLM's engine client (no vLLM, no GPU):
version detection, sampling-parameter mapping, configuration checks (with the numbers in
the messages), error mapping, delta streaming into TokenDeltas, abort on close and on
cancellation, stats, warm standby, and the KV key/layout layer shared with the torch engine."""

from __future__ import annotations

import asyncio
import enum
import json
import random
import types
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.common.generation import FinishReason, Sampling
from services.worker.engine import EngineRequest
from services.worker.tiny_model import SPECIAL_TOKENS, prose, train_tokenizer
from services.worker.vllm import (
    EngineConfigError,
    ModelFacts,
    VllmEngine,
    VllmNotInstalled,
    VllmSettings,
    check_cpu_engine_config,
    check_engine_config,
    detect_vllm_api,
    read_model_facts,
)
from services.worker.vllm.client import engine_args, open_vllm_client
from services.worker.vllm.errors import map_vllm_error
from services.worker.vllm.params import sampling_plan
from services.worker.vllm.request_args import PROCESSOR_NAMES, SAMPLER_KEY, guide_args, sampler_args
from services.worker.vllm.stats import (
    SchedulerSnapshot,
    SchedulerStatsSink,
    engine_stats,
    kv_fragmentation,
    snapshot_of,
)
from tests.engine_conformance import EngineConformance, EngineFactory, factory_fixture
from tests.engine_conformance import conf_engine, endless  # noqa: F401  (fixtures)

GIB = 1 << 30
EOS = 3  # <|im_end|>


# --- a stand-in vLLM: modules for detection, and an engine client ---------------------------
class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeSamplingParams:
    """Validates the way vLLM's SamplingParams does for what the adapter sends."""

    def __init__(self, **kwargs):
        if kwargs.get("max_tokens", 16) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {kwargs['max_tokens']}.")
        if kwargs.get("stop") and not kwargs.get("detokenize", True):
            raise ValueError("stop strings are only supported when detokenize is True")
        self.__dict__.update(kwargs)


class FakeStructured:
    def __init__(self, json=None):
        self.json = json


class FakeArgs:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class FakeStatLoggerBase:
    pass


class EngineDeadError(Exception):
    pass


class EngineGenerateError(Exception):
    pass


class VLLMValidationError(Exception):  # not a ValueError, as in some vLLM releases
    pass


class FakeAsyncLLM:
    """The parts of AsyncLLM the adapter uses, generating from a deterministic toy model.

    Greedy: the next token is a function of the context. Seeded (Ballast's sampler arguments
    in extra_args): the draw at generated position p comes from (seed, p), as Ballast's
    logits processor makes it inside real vLLM. Guided (vLLM's structured outputs, or Ballast's
    resumed guide in extra_args): the choice is kept to the ids the grammar allows, as vLLM's
    mask keeps it. Outputs are DELTAs of up to `chunk` tokens; EOS
    and stop-token ids are included in token_ids, stop strings are matched on the decoded
    output, as vLLM does."""

    def __init__(
        self,
        tokenizer,
        vocab: int,
        *,
        chunk: int = 3,
        eos_at: int | None = None,
        cached: int = 0,
        fail: BaseException | None = None,
        fail_after: int = 0,
        finish_override: str | None = None,
        step_delay: float = 0.0,
    ):
        self.tokenizer, self.vocab, self.chunk = tokenizer, vocab, chunk
        self.eos_at, self.cached, self.fail, self.fail_after = eos_at, cached, fail, fail_after
        self.finish_override, self.step_delay = finish_override, step_delay
        self.calls: list[tuple[dict, FakeSamplingParams, str]] = []
        self.priorities: list[int] = []
        self.aborted: list[str] = []
        self.slept: list[int] = []
        self.woken = 0
        self.shut_down = False
        self.errored = False
        self.snapshot: SchedulerSnapshot | None = None
        self.steps = 0
        self.active: set[str] = set()

    @classmethod
    def from_engine_args(cls, args, **kwargs):
        engine = cls(None, 0)
        engine.args, engine.from_kwargs = args, kwargs
        return engine

    def next_token(self, context: list[int], rng: random.Random | None, guide=None) -> int:
        if rng is None:
            token = 4 + (sum(context[-3:]) * 7 + len(context) * 13) % (self.vocab - 4)
        else:
            token = 4 + rng.randrange(self.vocab - 4)
        if guide is None:
            return token
        allowed = guide.mask().nonzero().flatten().tolist()
        return token if token in allowed else allowed[token % len(allowed)]

    def guide(self, params):
        """The grammar vLLM would mask this request with, or None."""
        from services.worker.guided import GuideCompiler
        from services.worker.vllm.request_args import GUIDE_KEY

        resumed = (getattr(params, "extra_args", None) or {}).get(GUIDE_KEY)
        fresh = getattr(params, "structured_outputs", None) or getattr(params, "guided_decoding", None)
        if resumed is None and fresh is None:
            return None
        if getattr(self, "_compiler", None) is None:
            self._compiler = GuideCompiler(self.tokenizer.to_str(), self.vocab, (EOS, 1))
        if resumed is not None:
            return self._compiler.guide(resumed["schema"], resumed["generated"])
        return self._compiler.guide(fresh.json)

    async def generate(self, prompt, params, request_id, priority=0):
        self.calls.append((prompt, params, request_id))
        self.priorities.append(priority)
        self.active.add(request_id)
        context = list(prompt["prompt_token_ids"])
        sampler = (getattr(params, "extra_args", None) or {}).get(SAMPLER_KEY)
        guide = self.guide(params)
        out_ids: list[int] = []
        step = 0
        try:
            while True:
                batch, finish, stop_reason = [], None, None
                for _ in range(self.chunk):
                    if self.fail is not None and step >= self.fail_after:
                        raise self.fail
                    rng = (
                        None
                        if sampler is None
                        else random.Random(f"{sampler['seed']}:{sampler['offset'] + len(out_ids)}")
                    )
                    token = EOS if step == self.eos_at else self.next_token(context, rng, guide)
                    if guide is not None:
                        try:
                            guide.advance(token)
                        except ValueError:  # past the document's EOS: nothing left to guide
                            guide = None
                    step += 1
                    batch.append(token)
                    context.append(token)
                    out_ids.append(token)
                    if token in (params.stop_token_ids or ()):
                        finish, stop_reason = "stop", token
                        break
                    text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                    hits = [s for s in (params.stop or ()) if s in text]
                    if hits:
                        finish, stop_reason = "stop", hits[0]
                        break
                    if len(out_ids) >= params.max_tokens:
                        finish = "length"
                        break
                finish = self.finish_override or finish
                yield SimpleNamespace(
                    request_id=request_id,
                    finished=finish is not None,
                    num_cached_tokens=self.cached if len(out_ids) == len(batch) else 0,
                    outputs=[SimpleNamespace(token_ids=batch, text="", finish_reason=finish, stop_reason=stop_reason)],
                )
                if finish is not None:
                    return
                await asyncio.sleep(self.step_delay)
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id)  # AsyncLLM aborts a request whose stream goes away
            raise
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def sleep(self, level):
        self.slept.append(level)

    async def wake_up(self):
        self.woken += 1

    def scheduler_stats(self):
        return self.snapshot

    def engine_steps(self):
        return self.steps

    def kv_capacity_tokens(self):
        return 4096

    def kv_block_tokens(self):
        return 16

    def shutdown(self):
        self.shut_down = True


def fake_modules(*, v1: bool = True, structured: str = "structured_outputs", delta: bool = True):
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    params = dict(SamplingParams=FakeSamplingParams)
    if delta:
        params["RequestOutputKind"] = RequestOutputKind
    if structured == "structured_outputs":
        params["StructuredOutputsParams"] = FakeStructured
    elif structured == "guided_decoding":
        params["GuidedDecodingParams"] = FakeStructured
    mods = {
        "vllm": module("vllm", __version__="0.33.0" if v1 else "0.5.5"),
        "vllm.exceptions": module("vllm.exceptions", VLLMValidationError=VLLMValidationError),
        "vllm.engine.arg_utils": module("vllm.engine.arg_utils", AsyncEngineArgs=FakeArgs),
        "vllm.sampling_params": module("vllm.sampling_params", **params),
        "vllm.inputs": module("vllm.inputs", TokensPrompt=dict),
    }
    if v1:
        mods["vllm.v1.engine.async_llm"] = module("x", AsyncLLM=FakeAsyncLLM)
        mods["vllm.v1.metrics.loggers"] = module("x", StatLoggerBase=FakeStatLoggerBase)
        mods["vllm.v1.engine.exceptions"] = module("x", EngineDeadError=EngineDeadError)
    else:
        mods["vllm.engine.async_llm_engine"] = module(
            "x", AsyncLLMEngine=FakeAsyncLLM, AsyncEngineDeadError=EngineDeadError
        )

    def importer(name):
        if name not in mods:
            raise ImportError(f"No module named {name!r}")
        return mods[name]

    return importer


API = detect_vllm_api(fake_modules())
TYPES = API.error_types


# --- a small model folder: real tokenizer, config.json, placeholder weights ---------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm-model")
    tok = train_tokenizer(prose(150), 320)
    (path / "tokenizer.json").write_text(tok.to_str())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[3], "add_bos_token": False})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": tok.get_vocab_size(),
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "max_position_embeddings": 512,
                "torch_dtype": "bfloat16",
                "eos_token_id": [3, 1],
            }
        )
    )
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


SETTINGS = VllmSettings(kv_cache_dtype="bfloat16", max_concurrency=4)


def make_engine(model_dir, tokenizer, settings=SETTINGS, api=API, **fake_options):
    fake = FakeAsyncLLM(tokenizer, tokenizer.get_vocab_size(), **fake_options)
    engine = VllmEngine(
        model_dir, "tiny", settings, api=api, client_factory=lambda *a: fake, gpu_memory=lambda: 80 * GIB
    )
    return engine, fake


def request(ids, generated=(), response_format="", tenant="", **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 12)
    return EngineRequest(
        "r1", tuple(ids), tuple(generated), Sampling(**sampling), tenant=tenant, response_format=response_format
    )


async def collect(engine, req):
    deltas = [d async for d in engine.generate(req)]
    assert all(d.finish_reason is None for d in deltas[:-1]) and deltas[-1].finish_reason is not None
    tokens = [t for d in deltas for t in d.token_ids]
    return deltas, tokens, "".join(d.text for d in deltas)


PROMPT = [10, 11, 12, 13, 14]


# --- version detection ---------------------------------------------------------------------
def test_detects_the_v1_engine_and_structured_outputs():
    api = detect_vllm_api(fake_modules())
    assert (api.version, api.engine_kind, api.engine_class) == ("0.33.0", "AsyncLLM", FakeAsyncLLM)
    assert api.delta_output_kind is RequestOutputKind.DELTA
    assert api.structured_field == "structured_outputs" and api.stat_logger_base is FakeStatLoggerBase
    assert api.dead_errors == (EngineDeadError,) and api.supports_cache_salt
    assert api.tokens_prompt([1, 2], cache_salt="acme") == {"prompt_token_ids": [1, 2], "cache_salt": "acme"}
    assert api.structured('{"type":"object"}')["structured_outputs"].json == '{"type":"object"}'


def test_detects_the_engine_before_v1_and_guided_decoding():
    api = detect_vllm_api(fake_modules(v1=False, structured="guided_decoding"))
    assert (api.engine_kind, api.structured_field, api.stat_logger_base) == ("AsyncLLMEngine", "guided_decoding", None)
    assert not api.supports_cache_salt
    assert api.tokens_prompt([1], cache_salt="acme") == {"prompt_token_ids": [1]}


def test_detection_without_guidance_or_vllm_or_delta_outputs():
    assert detect_vllm_api(fake_modules(structured="")).structured("{}") == {}
    with pytest.raises(VllmNotInstalled, match="gpu extra"):
        detect_vllm_api(lambda name: (_ for _ in ()).throw(ImportError(name)))
    with pytest.raises(RuntimeError, match="0.33.0 lacks RequestOutputKind"):
        detect_vllm_api(fake_modules(delta=False))


# --- sampling parameters -------------------------------------------------------------------
def test_greedy_mapping_is_explicit():
    plan = sampling_plan(request(PROMPT, top_p=0.5, seed=9), [3, 1], RequestOutputKind.DELTA)
    assert plan.kwargs == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "max_tokens": 12,
        "stop": None,
        "stop_token_ids": [1, 3],
        "ignore_eos": True,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "detokenize": False,
        "output_kind": RequestOutputKind.DELTA,
        "extra_args": None,
    }
    assert (plan.schema, plan.resumed_guide) == ("", False)


def test_seeded_sampling_goes_to_the_position_sampler_and_vllm_decodes_greedily():
    fresh = sampling_plan(request(PROMPT, temperature=0.7, top_p=0.9, seed=42, stop=("\n",)), [], None)
    assert fresh.kwargs["extra_args"] == sampler_args(42, 0, 0.7, 0.9)
    # vLLM's own sampler never draws: the processor leaves one finite logit per sampled row.
    assert (fresh.kwargs["temperature"], fresh.kwargs["top_p"], fresh.kwargs["seed"]) == (0.0, 1.0, None)
    assert fresh.kwargs["stop"] == ["\n"] and fresh.kwargs["detokenize"] is True
    assert fresh.kwargs["stop_token_ids"] is None
    # A resume at generated position 3 continues the same (seed, position) draws.
    resumed = sampling_plan(request(PROMPT, generated=[5, 6, 7], temperature=0.7, seed=42), [], None)
    assert resumed.kwargs["extra_args"][SAMPLER_KEY] == {"seed": 42, "offset": 3, "temperature": 0.7, "top_p": 1.0}
    # No seed: fresh randomness per request, still drawn by position.
    unseeded = [
        sampling_plan(request(PROMPT, temperature=0.7), [], None).kwargs["extra_args"][SAMPLER_KEY]["seed"]
        for _ in range(2)
    ]
    assert unseeded[0] != unseeded[1]


def test_response_format_goes_to_vllm_fresh_and_to_the_resumed_guide_on_resume():
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    plan = sampling_plan(request(PROMPT, response_format=schema), [3], None)
    assert (plan.schema, plan.resumed_guide, plan.kwargs["extra_args"]) == (schema, False, None)
    resumed = sampling_plan(request(PROMPT, generated=[9], response_format=schema), [3], None)
    assert (resumed.schema, resumed.resumed_guide) == ("", True)
    assert resumed.kwargs["extra_args"] == guide_args(schema, [9])


async def test_engine_sends_guidance_in_the_field_the_vllm_release_uses(model_dir, tokenizer):
    schema = '{"type": "object"}'
    for structured in ("structured_outputs", "guided_decoding"):
        api = detect_vllm_api(fake_modules(structured=structured))
        engine, fake = make_engine(model_dir, tokenizer, api=api)
        await engine.start()
        await collect(engine, request(PROMPT, response_format=schema))
        assert getattr(fake.calls[-1][1], structured).json == schema
        # Resumed after "{": the schema goes to Ballast's guide (extra_args), not vLLM's field.
        brace = tokenizer.encode("{", add_special_tokens=False).ids
        await collect(engine, request(PROMPT, generated=brace, response_format=schema))
        params = fake.calls[-1][1]
        assert not hasattr(params, structured)
        assert params.extra_args == guide_args(schema, brace)
        assert engine.stats().extra["guided_resumes_total"] == 1
        # Ids that the schema does not accept are bad input, refused before vLLM sees them.
        with pytest.raises(InvalidArgument, match="do not fit response_format"):
            await collect(
                engine,
                request(PROMPT, generated=tokenizer.encode("no", add_special_tokens=False).ids, response_format=schema),
            )


# --- configuration checks ------------------------------------------------------------------
FACTS = ModelFacts(
    max_position_embeddings=32768,
    layers=32,
    kv_heads=8,
    head_dim=128,
    weights_dtype="bfloat16",
    weights_bytes=16 * GIB,
    vocab_size=128256,
)


def test_kv_dtype_auto_or_unset_is_refused_with_the_weights_dtype():
    for kv in ("auto", ""):
        with pytest.raises(EngineConfigError, match=r"kv_cache_dtype is .*explicit.*\(bfloat16\).*fp8"):
            check_engine_config(VllmSettings(kv_cache_dtype=kv), FACTS, 80 * GIB)


def test_kv_dtype_wider_than_or_mismatching_the_weights_is_refused():
    with pytest.raises(EngineConfigError, match=r"float32 \(4 bytes\) is wider than the weights \(bfloat16, 2 bytes\)"):
        check_engine_config(VllmSettings(kv_cache_dtype="float32"), FACTS, 80 * GIB)
    with pytest.raises(EngineConfigError, match="float16 does not match the weights"):
        check_engine_config(VllmSettings(kv_cache_dtype="float16"), FACTS, 80 * GIB)
    fp32 = ModelFacts(2048, 2, 4, 16, "float32", 1 << 20)
    plan = check_engine_config(VllmSettings(kv_cache_dtype="float16"), fp32, None)
    assert (plan.dtype, plan.vllm_kv_cache_dtype) == ("float32", "float16")


def test_explicit_kv_dtype_plan_and_what_vllm_is_given():
    same = check_engine_config(VllmSettings(kv_cache_dtype="bfloat16"), FACTS, 80 * GIB)
    # 2 x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB per token.
    assert same.kv_bytes_per_token == 131072 and same.vllm_kv_cache_dtype == "auto"
    assert same.max_model_len == 32768 and same.dtype == "bfloat16"
    budget = int(80 * GIB * 0.9) - 16 * GIB
    assert same.kv_budget_bytes == budget and same.kv_capacity_tokens == budget // 131072
    fp8 = check_engine_config(VllmSettings(kv_cache_dtype="fp8"), FACTS, 80 * GIB)
    assert fp8.vllm_kv_cache_dtype == "fp8" and fp8.kv_bytes_per_token == 65536
    assert fp8.kv_capacity_tokens == 2 * same.kv_capacity_tokens


def test_max_model_len_beyond_the_models_maximum_is_refused():
    with pytest.raises(EngineConfigError, match="max_model_len 40000 exceeds the model's own maximum of 32768"):
        check_engine_config(VllmSettings(kv_cache_dtype="bfloat16", max_model_len=40000), FACTS, 80 * GIB)


def test_max_model_len_beyond_the_kv_memory_fails_with_the_numbers():
    # 24 GiB x 0.9 = 21.6 GiB; minus 16 GiB of weights leaves 5.6 GiB = 45875 tokens at 128 KiB.
    settings = VllmSettings(kv_cache_dtype="bfloat16", max_model_len=32768)
    plan = check_engine_config(settings, FACTS, 24 * GIB)
    assert plan.kv_capacity_tokens == (int(24 * GIB * 0.9) - 16 * GIB) // 131072 == 45875
    with pytest.raises(EngineConfigError) as info:
        check_engine_config(VllmSettings(kv_cache_dtype="bfloat16", gpu_memory_utilization=0.8), FACTS, 24 * GIB)
    message = str(info.value)
    for number in (
        "32768 x 131072 bytes per token",
        "4.00 GiB of KV cache",
        "only 3.20 GiB",
        "24.00 GiB x 0.8",
        "weights 16.00 GiB",
        "at most 26214",
    ):
        assert number in message, message
    with pytest.raises(EngineConfigError, match=r"weights need 16.00 GiB .* of this GPU's 16.00 GiB is 14.40 GiB"):
        check_engine_config(settings, FACTS, 16 * GIB)


def test_unknown_gpu_memory_skips_only_the_memory_checks():
    plan = check_engine_config(VllmSettings(kv_cache_dtype="fp8"), FACTS, None)
    assert plan.kv_capacity_tokens is None and plan.gpu_memory_bytes is None


def test_dtype_override_and_mla_sizes():
    plan = check_engine_config(
        VllmSettings(kv_cache_dtype="float16", dtype="float16"),
        ModelFacts(4096, 2, 4, 16, "float32", 8 * GIB),
        80 * GIB,
    )
    assert plan.kv_budget_bytes == int(80 * GIB * 0.9) - 4 * GIB  # fp32 weights run in fp16
    mla = ModelFacts(163840, 61, 128, 128, "bfloat16", 0, mla_latent_dim=512 + 64)
    assert mla.kv_bytes_per_token("fp8") == 61 * 576
    with pytest.raises(EngineConfigError, match="torch_dtype"):
        check_engine_config(VllmSettings(kv_cache_dtype="fp8"), ModelFacts(1, 1, 1, 1, "", 0), None)


def test_reads_model_facts_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "hidden_size": 3584,
                "max_position_embeddings": 32768,
                "torch_dtype": "bfloat16",
                "vocab_size": 152064,
                "sliding_window": 131072,
                "use_sliding_window": False,
            }
        )
    )
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 999)  # ignored beside safetensors
    facts = read_model_facts(tmp_path)
    assert facts == ModelFacts(32768, 28, 4, 128, "bfloat16", 100, 152064, 0, True)


def test_worker_config_fields_and_engine_args(model_dir):
    from services.config import load_config

    config = load_config(
        environ={
            "BALLAST__WORKER__ENGINE": "vllm",
            "BALLAST__WORKER__KV_CACHE_DTYPE": "fp8",
            "BALLAST__WORKER__MAX_MODEL_LEN": "256",
        }
    )
    worker = config.worker
    assert (worker.enable_chunked_prefill, worker.enable_prefix_caching, worker.gpu_memory_utilization) == (
        True,
        True,
        0.9,
    )
    assert load_config(environ={}).worker.kv_cache_dtype == ""  # unset: a vLLM worker refuses to start
    settings = VllmSettings.from_worker_config(worker)
    plan = check_engine_config(settings, read_model_facts(model_dir), 80 * GIB)
    args = engine_args(model_dir, "tiny", settings, plan)
    assert args == {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "served_model_name": "tiny",
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "max_model_len": 256,
        "gpu_memory_utilization": 0.9,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "enforce_eager": False,
        "enable_sleep_mode": False,
        "max_num_seqs": 8,
        "scheduling_policy": "priority",
        "disable_log_stats": False,
        "trust_remote_code": False,
        "logits_processors": list(PROCESSOR_NAMES),
    }


def test_opens_the_engine_with_explicit_args_and_a_stats_logger(model_dir):
    settings = VllmSettings(kv_cache_dtype="bfloat16")
    plan = check_engine_config(settings, read_model_facts(model_dir), 80 * GIB)
    client = open_vllm_client(API, model_dir, "tiny", settings, plan)
    engine = client._engine
    assert engine.args.kwargs["kv_cache_dtype"] == "auto" and engine.args.kwargs["dtype"] == "bfloat16"
    (logger_class,) = engine.from_kwargs["stat_loggers"]
    assert issubclass(logger_class, FakeStatLoggerBase)
    logger_class(None, 0).record(
        SimpleNamespace(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25), None, engine_idx=0
    )
    snapshot = client.scheduler_stats()
    assert (snapshot.running, snapshot.waiting, snapshot.kv_usage) == (2, 1, 0.25)
    assert client.engine_steps() == 1


# --- errors ----------------------------------------------------------------------------------
def wrapped(cause: BaseException) -> BaseException:
    try:
        raise EngineGenerateError() from cause
    except EngineGenerateError as exc:
        return exc


def test_error_mapping():
    long = ValueError("The decoder prompt (length 9000) is longer than the maximum model length of 8192.")
    error = map_vllm_error(long, TYPES)
    assert isinstance(error, InvalidArgument) and "length 9000" in error.message
    assert isinstance(map_vllm_error(VLLMValidationError("bad top_k"), TYPES), InvalidArgument)
    assert isinstance(map_vllm_error(wrapped(ValueError("bad")), TYPES), InvalidArgument)
    dead = map_vllm_error(EngineDeadError("EngineCore died"), TYPES)
    assert isinstance(dead, Unavailable) and "dead" in dead.message and dead.retriable
    other = map_vllm_error(wrapped(RuntimeError("CUDA error")), TYPES)
    assert isinstance(other, Unavailable) and "dead" not in other.message
    assert "dead" in map_vllm_error(RuntimeError("x"), TYPES, engine_dead=lambda: True).message
    # An error merely raised while handling another is not caused by it.
    try:
        try:
            raise ValueError("inner")
        except ValueError:
            raise RuntimeError("outer")
    except RuntimeError as exc:
        assert isinstance(map_vllm_error(exc, TYPES), Unavailable)


# --- streaming -------------------------------------------------------------------------------
async def test_greedy_stream_becomes_token_deltas(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=3, cached=2)
    await engine.start()
    deltas, tokens, text = await collect(engine, request(PROMPT, max_tokens=10, tenant="acme"))
    expected, context = [], list(PROMPT)
    for _ in range(10):
        expected.append(fake.next_token(context, None))
        context.append(expected[-1])
    assert tokens == expected and deltas[-1].finish_reason == FinishReason.LENGTH
    assert [len(d.token_ids) for d in deltas] == [3, 3, 3, 1]
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert deltas[0].prefill_tokens == len(PROMPT) - 2 and deltas[1].prefill_tokens is None
    prompt, params, request_id = fake.calls[-1]
    assert prompt == {"prompt_token_ids": PROMPT, "cache_salt": "acme"} and request_id.startswith("r1-")
    assert params.output_kind is RequestOutputKind.DELTA and params.max_tokens == 10
    assert fake.aborted == [] and engine.stats().running == 0


async def test_requests_reach_vllm_with_their_tiers_priority_and_a_resume_one_tier_ahead(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer)
    await engine.start()
    for priority in (0, 1, 2):  # tier S, A, B (services.worker.servicer)
        await collect(engine, replace(request(PROMPT, max_tokens=4), priority=priority))
    await collect(engine, replace(request(PROMPT, generated=[5, 6], max_tokens=4), priority=2))
    assert fake.priorities == [0, 1, 2, 1]


async def test_resume_sends_prompt_plus_generated_and_continues_the_text(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=1)  # one token per delta
    await engine.start()
    full_deltas, full, full_text = await collect(engine, request(PROMPT, max_tokens=12))
    for k in (1, 5, 11):
        _, rest, rest_text = await collect(engine, request(PROMPT, generated=full[:k], max_tokens=12 - k))
        assert fake.calls[-1][0]["prompt_token_ids"] == PROMPT + full[:k]
        assert full[:k] + rest == full
        sent = "".join(d.text for d in full_deltas[:k])  # what the client had before the resume
        assert sent + rest_text == full_text, k


async def test_seeded_resume_is_reproducible(model_dir, tokenizer):
    engine, _ = make_engine(model_dir, tokenizer)
    await engine.start()
    a = await collect(engine, request(PROMPT, temperature=0.9, seed=5, max_tokens=8))
    b = await collect(engine, request(PROMPT, temperature=0.9, seed=5, max_tokens=8))
    assert a[1] == b[1]
    r1 = await collect(engine, request(PROMPT, generated=a[1][:3], temperature=0.9, seed=5, max_tokens=5))
    r2 = await collect(engine, request(PROMPT, generated=a[1][:3], temperature=0.9, seed=5, max_tokens=5))
    assert r1[1] == r2[1]


async def test_eos_ends_the_stream_without_being_emitted(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=4, eos_at=5)
    await engine.start()
    deltas, tokens, text = await collect(engine, request(PROMPT, max_tokens=20))
    assert len(tokens) == 5 and EOS not in tokens and deltas[-1].finish_reason == FinishReason.STOP
    assert deltas[-1].token_ids == [tokens[-1]]  # the EOS delta still carries the token before it
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert fake.calls[-1][1].stop_token_ids == [1, 3] and fake.calls[-1][1].ignore_eos is True


async def test_eos_override_disables_eos(model_dir, tokenizer):
    fake = FakeAsyncLLM(tokenizer, tokenizer.get_vocab_size(), eos_at=2)
    engine = VllmEngine(
        model_dir, "tiny", SETTINGS, eos_token_ids=(), api=API, client_factory=lambda *a: fake, gpu_memory=lambda: None
    )
    await engine.start()
    _, tokens, _ = await collect(engine, request(PROMPT, max_tokens=6))
    assert len(tokens) == 6 and tokens[2] == EOS and fake.calls[-1][1].stop_token_ids is None


async def test_stop_string_matched_by_vllm(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=2)
    await engine.start()
    _, full, full_text = await collect(engine, request(PROMPT, max_tokens=12))
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    deltas, tokens, text = await collect(engine, request(PROMPT, max_tokens=12, stop=(stop,)))
    assert deltas[-1].finish_reason == FinishReason.STOP and text == full_text[: full_text.index(stop)]
    assert tokens == full[: len(tokens)] and fake.calls[-1][1].stop == [stop]
    assert fake.aborted == []  # vLLM finished the request itself


async def test_stop_string_across_the_resume_point_is_found_and_aborts(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=1)
    await engine.start()
    _, full, _ = await collect(engine, request(PROMPT, max_tokens=12))
    k = 6
    before = tokenizer.decode(full[:k], skip_special_tokens=True)
    after = tokenizer.decode(full, skip_special_tokens=True)
    assert not before.endswith("\ufffd")
    stop = after[len(before) - 1 : len(before) + 1]  # one character on each side of the resume point
    # The uninterrupted stream (vLLM matches the stop string itself there).
    whole, whole_tokens, whole_text = await collect(engine, request(PROMPT, max_tokens=12, stop=(stop,)))
    assert whole[-1].finish_reason == FinishReason.STOP and fake.aborted == []
    sent = "".join(d.text for d in whole[:k])  # what the client had when the first replica died
    deltas, tokens, text = await collect(engine, request(PROMPT, generated=full[:k], max_tokens=6, stop=(stop,)))
    assert deltas[-1].finish_reason == FinishReason.STOP
    assert sent + text == whole_text and full[:k] + tokens == whole_tokens
    assert set(fake.aborted) == {fake.calls[-1][2]}  # vLLM could not see it: aborted by us


async def test_stop_already_reached_or_nothing_to_generate_never_calls_vllm(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer)
    await engine.start()
    _, full, full_text = await collect(engine, request(PROMPT, max_tokens=8))
    deltas, tokens, _ = await collect(engine, request(PROMPT, generated=full, stop=(full_text[1:3],)))
    assert tokens == [] and deltas[-1].finish_reason == FinishReason.STOP
    deltas, tokens, _ = await collect(engine, request(PROMPT, generated=full, max_tokens=0))
    assert tokens == [] and deltas[-1].finish_reason == FinishReason.LENGTH
    assert len(fake.calls) == 1


async def test_aclose_aborts_the_vllm_request(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=1)
    await engine.start()
    stream = engine.generate(request(PROMPT, max_tokens=100))
    await stream.__anext__()
    await stream.__anext__()
    assert engine._in_flight == 1
    await stream.aclose()
    request_id = fake.calls[-1][2]
    assert request_id in fake.aborted and not fake.active
    assert engine._in_flight == 0 and engine.stats().running == 0


async def test_cancelling_the_consumer_aborts_and_reraises(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=1, step_delay=0.01)
    await engine.start()
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(request(PROMPT, max_tokens=400)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.calls[-1][2] in fake.aborted and engine._in_flight == 0


@pytest.mark.parametrize(
    "fail, fail_after, kind, match",
    [
        (
            ValueError("The decoder prompt (length 600) is longer than the maximum model length of 512."),
            0,
            InvalidArgument,
            "length 600",
        ),
        (EngineDeadError("EngineCore encountered an issue"), 4, Unavailable, "dead"),
        (wrapped(RuntimeError("illegal memory access")), 1, Unavailable, "illegal memory access"),
    ],
)
async def test_vllm_errors_become_typed_errors(model_dir, tokenizer, fail, fail_after, kind, match):
    engine, fake = make_engine(model_dir, tokenizer, chunk=2, fail=fail, fail_after=fail_after)
    await engine.start()
    with pytest.raises(kind, match=match):
        await collect(engine, request(PROMPT, max_tokens=20))
    assert engine._in_flight == 0


async def test_aborted_by_vllm_is_unavailable(model_dir, tokenizer):
    engine, _ = make_engine(model_dir, tokenizer, finish_override="abort")
    await engine.start()
    with pytest.raises(Unavailable, match="aborted"):
        await collect(engine, request(PROMPT))


@pytest.mark.parametrize(
    "prompt, generated, extra, match",
    [
        ([], (), {}, "prompt is empty"),
        ([5, 100000], (), {}, "outside the vocabulary"),
        ([5] * 500, (6,) * 10, {"max_tokens": 3}, "513 tokens exceeds the model's context of 512"),
        ([5], (), {"temperature": -1.0}, "temperature"),
        ([5], (), {"temperature": float("inf")}, "temperature"),
        ([5], (), {"top_p": 0.0}, "top_p"),
        ([5], (), {"stop": ("",)}, "stop"),
        ([5], (), {"response_format": "{not json"}, "not valid JSON"),
        ([5], (), {"response_format": "[1]"}, "JSON Schema object"),
    ],
)
async def test_invalid_requests_fail_before_vllm(model_dir, tokenizer, prompt, generated, extra, match):
    engine, fake = make_engine(model_dir, tokenizer)
    await engine.start()
    with pytest.raises(InvalidArgument, match=match):
        engine.generate(request(prompt, generated, **extra))
    assert fake.calls == []


async def test_sampling_params_refused_by_vllm_are_invalid(model_dir, tokenizer):
    class Strict(FakeSamplingParams):
        def __init__(self, **kwargs):
            raise ValueError("top_p must be in (0, 1], got 1.5.")

    api = detect_vllm_api(fake_modules())
    object.__setattr__(api, "sampling_params_class", Strict)
    engine, fake = make_engine(model_dir, tokenizer, api=api)
    await engine.start()
    with pytest.raises(InvalidArgument, match="top_p"):
        await collect(engine, request(PROMPT))
    assert fake.calls == [] and engine._in_flight == 0


async def test_admission_is_bounded(model_dir, tokenizer):
    settings = VllmSettings(kv_cache_dtype="bfloat16", max_concurrency=1, max_waiting=0)
    engine, _ = make_engine(model_dir, tokenizer, settings, chunk=1, step_delay=0.01)
    await engine.start()
    holder = engine.generate(request(PROMPT, max_tokens=50))
    await holder.__anext__()
    with pytest.raises(ResourceExhausted):
        await engine.generate(request(PROMPT)).__anext__()
    await holder.aclose()
    assert len((await collect(engine, request(PROMPT, max_tokens=2)))[1]) == 2


async def test_not_started_or_stopped_is_unavailable(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer)
    with pytest.raises(Unavailable):
        await collect(engine, request(PROMPT))
    await engine.start()
    await engine.stop()
    assert fake.shut_down
    with pytest.raises(Unavailable):
        await collect(engine, request(PROMPT))


async def test_start_refuses_a_bad_configuration_before_opening_vllm(model_dir, tokenizer):
    opened = []
    engine = VllmEngine(
        model_dir,
        "tiny",
        VllmSettings(kv_cache_dtype="auto"),
        api=API,
        client_factory=lambda *a: opened.append(a),
        gpu_memory=lambda: 80 * GIB,
    )
    with pytest.raises(EngineConfigError, match="auto"):
        await engine.start()
    assert opened == []
    capped = VllmEngine(
        model_dir,
        "tiny",
        VllmSettings(kv_cache_dtype="fp8", max_model_len=256),
        api=API,
        client_factory=lambda *a: None,
    )
    assert capped.model.max_context == 256 and capped.model.eos_token_ids == (3, 1)
    assert capped.tokenize("The customer") == tokenizer.encode("The customer", add_special_tokens=False).ids


# --- stats -----------------------------------------------------------------------------------
def test_scheduler_snapshots_and_engine_stats():
    assert snapshot_of(SimpleNamespace(num_running_reqs=3, num_waiting_reqs=0, gpu_cache_usage=0.5)).kv_usage == 0.5
    snapshot = SchedulerSnapshot(running=3, waiting=2, kv_usage=0.5, at=0.0)
    stats = engine_stats(snapshot, in_flight=4, max_concurrency=8, kv_capacity_tokens=1000, extra={})
    assert (stats.running, stats.waiting, stats.kv_tokens, stats.kv_used) == (3, 1, 500, 0.5)
    idle = engine_stats(snapshot, in_flight=0, max_concurrency=8, kv_capacity_tokens=1000, extra={})
    assert (idle.running, idle.waiting, idle.kv_used) == (0, 0, 0.0)  # a stale snapshot is ignored
    blind = engine_stats(None, in_flight=10, max_concurrency=8, kv_capacity_tokens=1000, extra={})
    assert (blind.running, blind.waiting) == (8, 2)
    sink = SchedulerStatsSink()
    sink.record(None)
    assert sink.latest is None and sink.steps == 0
    # vLLM hands over every step's stats, a prefill-only step's too: each is a step counted...
    for _ in range(3):
        sink.logger_class(object)(None, 0).record(SimpleNamespace(num_running_reqs=1, num_waiting_reqs=4))
    assert sink.steps == 3 and sink.latest is not None and sink.latest.waiting == 4
    # ...but not the empty loops of an engine whose requests all wait (a grammar compile, say).
    sink.record(SimpleNamespace(num_running_reqs=0, num_waiting_reqs=1))
    assert sink.steps == 3 and sink.latest.running == 0


async def test_engine_stats_report_vllm_kv_use(model_dir, tokenizer):
    engine, fake = make_engine(model_dir, tokenizer, chunk=1)
    await engine.start()
    stream = engine.generate(request(PROMPT, max_tokens=20))
    await stream.__anext__()
    fake.snapshot = SchedulerSnapshot(running=1, waiting=0, kv_usage=0.125, at=0.0)
    fake.steps = 7
    assert engine.steps == 7  # the client's count of vLLM's steps
    stats = engine.stats()
    assert (stats.running, stats.kv_capacity_tokens, stats.kv_tokens, stats.kv_used) == (1, 4096, 512, 0.125)
    assert stats.extra["kv_cache_usage"] == 0.125 and stats.extra["generated_tokens_total"] >= 1
    await stream.aclose()


# --- warm standby ----------------------------------------------------------------------------
async def test_standby_starts_asleep_and_wakes_for_a_request(model_dir, tokenizer):
    settings = VllmSettings(kv_cache_dtype="bfloat16", sleep_on_standby=True)
    engine, fake = make_engine(model_dir, tokenizer, settings)
    await engine.start()
    assert fake.slept == [1] and engine.sleeping and engine.stats().extra["sleeping"] == 1.0
    results = await asyncio.gather(*(collect(engine, request(PROMPT, max_tokens=3)) for _ in range(3)))
    assert fake.woken == 1 and not engine.sleeping and all(len(r[1]) == 3 for r in results)
    await engine.sleep(2)
    await engine.sleep()
    assert fake.slept == [1, 2]
    await engine.wake_up()
    await engine.wake_up()
    assert fake.woken == 2


async def test_a_request_during_a_sleep_waits_and_wakes_the_engine(model_dir, tokenizer):
    settings = VllmSettings(kv_cache_dtype="bfloat16", sleep_on_standby=True)
    engine, fake = make_engine(model_dir, tokenizer, settings)
    await engine.start()
    await engine.wake_up()
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_sleep(level):
        fake.slept.append(level)
        entered.set()
        await release.wait()

    fake.sleep = slow_sleep
    sleeping = asyncio.create_task(engine.sleep())
    await entered.wait()
    answer = asyncio.create_task(collect(engine, request(PROMPT, max_tokens=3)))
    await asyncio.sleep(0.01)
    assert not answer.done() and len(fake.calls) == 0
    release.set()
    await sleeping
    assert len((await answer)[1]) == 3 and fake.woken == 2 and not engine.sleeping


async def test_sleep_needs_sleep_mode_and_an_idle_engine(model_dir, tokenizer):
    engine, _ = make_engine(model_dir, tokenizer)
    await engine.start()
    with pytest.raises(RuntimeError, match="sleep_on_standby"):
        await engine.sleep()
    settings = VllmSettings(kv_cache_dtype="bfloat16", sleep_on_standby=True)
    engine, fake = make_engine(model_dir, tokenizer, settings, chunk=1)
    await engine.start()
    stream = engine.generate(request(PROMPT, max_tokens=20))
    await stream.__anext__()
    with pytest.raises(RuntimeError, match="1 requests are in flight"):
        await engine.sleep()
    await stream.aclose()
    await engine.sleep()
    assert fake.slept == [1, 1] and engine.sleeping


# --- session KV keys and layout, shared with the torch engine --------------------------------
def test_connector_keys_match_the_torch_engines_block_names():
    from services.cache.blocks import chain_hashes
    from services.cache.types import KVScope
    from services.worker.vllm.kv_keys import ConnectorKeys, stored_layout

    keys = ConnectorKeys("abc123", block_tokens=32, page_tokens=16)
    tokens = list(range(100, 197))  # 97 tokens: 3 full blocks, the last one holds token 96
    assert keys.block_names("acme", tokens) == chain_hashes(KVScope("abc123", "acme"), 32, tokens)
    assert len(keys.lookup_names("acme", tokens)) == 3 and len(keys.lookup_names("acme", tokens[:96])) == 2
    assert keys.block_names("other", tokens) != keys.block_names("acme", tokens)
    assert keys.loadable_tokens(97, cached_blocks=3, computed_tokens=16) == 80
    assert keys.loadable_tokens(96, cached_blocks=3, computed_tokens=0) == 64
    assert keys.pages_of(1, [7, 3, 9, 1, 4]) == [9, 1]
    with pytest.raises(ValueError, match="needs pages 4..5"):
        keys.pages_of(2, [7, 3, 9, 1, 4])
    with pytest.raises(ValueError, match="kv_block_tokens 24 must be a positive multiple of vLLM's block_size 16"):
        ConnectorKeys("abc123", 24, 16)
    layout = stored_layout(FACTS, "bfloat16", 32)
    assert layout.shape == (32, 2, 8, 32, 128) and layout.dtype == "bfloat16"
    assert stored_layout(FACTS, "fp8", 32) is None
    assert stored_layout(ModelFacts(1, 1, 1, 1, "bfloat16", 0, mla_latent_dim=8), "bfloat16", 32) is None


def _vec_pages(keys, values, page_table, pages, page):
    """A layer's KV in vLLM's CPU "vec" layout, written by hand from its definition:
    [pages, heads, page, 2 * head_dim], per (page, head) the keys transposed then the values."""
    import torch

    _one, heads, tokens, head_dim = keys.shape
    cache = torch.zeros(pages, heads, page, 2 * head_dim, dtype=keys.dtype)
    flat = cache.view(pages, heads, 2 * page * head_dim)
    for t in range(tokens):
        slot, offset = page_table[t // page], t % page
        for d in range(head_dim):
            flat[slot, :, d * page + offset] = keys[0, :, t, d]
        flat[slot, :, page * head_dim + offset * head_dim : page * head_dim + (offset + 1) * head_dim] = values[0, :, t]
    return cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_pages_gather_to_the_torch_engines_bytes_and_scatter_back(dtype):
    torch = pytest.importorskip("torch")
    from services.cache.types import KVLayout
    from services.worker.kv.tensors import NAMED_DTYPES, encode_blocks
    from services.worker.vllm.kv_keys import ConnectorKeys
    from services.worker.vllm.kv_pages import block_from_payload, block_payload, gather_block, scatter_block

    layers, heads, head_dim, block, page = 3, 2, 4, 8, 4
    keys = ConnectorKeys("v", block, page)
    tokens = 2 * block
    generator = torch.Generator().manual_seed(0)
    pairs = [
        (
            torch.randn(1, heads, tokens, head_dim, generator=generator).to(NAMED_DTYPES[dtype]),
            torch.randn(1, heads, tokens, head_dim, generator=generator).to(NAMED_DTYPES[dtype]),
        )
        for _ in range(layers)
    ]
    layout = KVLayout(dtype, (layers, 2, heads, block, head_dim), layers, block)
    expected = encode_blocks(pairs, layout, 0, 2)

    page_table = [5, 0, 7, 2]  # the request's pages, in token order, scattered over 9 pages
    caches = [_vec_pages(k, v, page_table, 9, page) for k, v in pairs]
    for index in range(2):
        pages = keys.pages_of(index, page_table)
        payload, crc = block_payload(gather_block(caches, pages, head_dim))
        assert bytes(payload) == bytes(expected[index][0]) and crc == expected[index][1]

        fresh = [torch.zeros_like(c) for c in caches]
        restored = block_from_payload(bytearray(payload), layout.shape, NAMED_DTYPES[dtype])
        scatter_block(restored, fresh, pages, head_dim)
        for original, copy in zip(caches, fresh):
            assert torch.equal(original[pages], copy[pages])
            others = [p for p in range(9) if p not in pages]
            assert not copy[others].any()

        # Pages vLLM's prefix cache already holds are left as they are.
        fresh = [torch.full_like(c, 7.0) for c in caches]
        scatter_block(restored, fresh, pages, head_dim, skip_pages=1)
        for original, copy in zip(caches, fresh):
            assert (copy[pages[0]] == 7.0).all() and torch.equal(original[pages[1]], copy[pages[1]])


# --- the shared conformance suite, through the adapter over the stand-in ---------------------
def _stand_in_engine(model_dir, eos_token_ids=None, max_concurrency=4):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    fake = FakeAsyncLLM(tokenizer, tokenizer.get_vocab_size(), chunk=2)
    return VllmEngine(
        model_dir,
        "conformance",
        replace(SETTINGS, max_concurrency=max_concurrency),
        eos_token_ids=eos_token_ids,
        api=API,
        client_factory=lambda *a: fake,
        gpu_memory=lambda: 80 * GIB,
    )


engine_factory = factory_fixture(EngineFactory("vllm-stand-in", _stand_in_engine))


@pytest.fixture(scope="module")
def conformance_model_dir(model_dir):
    return model_dir


class TestStandInConformance(EngineConformance):
    """Every engine promise that does not depend on the model itself holds through the
    adapter; the real vLLM run of this suite is tests/gpu/test_vllm_conformance.py."""


# --- vLLM on CPUs ------------------------------------------------------------------------
TINY_FP32 = ModelFacts(
    max_position_embeddings=2048,
    layers=2,
    kv_heads=2,
    head_dim=32,
    weights_dtype="float32",
    weights_bytes=700_000,
    vocab_size=512,
)


def test_cpu_plan_puts_the_kv_cache_in_the_configured_host_memory():
    plan = check_cpu_engine_config(VllmSettings(kv_cache_dtype="float32", cpu_kv_cache_bytes=2 * GIB), TINY_FP32)
    assert plan.platform == "cpu" and plan.vllm_kv_cache_dtype == "auto"
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4 == 1024
    assert (plan.kv_budget_bytes, plan.kv_capacity_tokens) == (2 * GIB, 2 * GIB // 1024)


def test_cpu_plan_refuses_what_vllms_cpu_kernels_would_fail_on():
    with pytest.raises(EngineConfigError, match="head dim is 16"):
        check_cpu_engine_config(VllmSettings(kv_cache_dtype="float32"), replace(TINY_FP32, head_dim=16))
    with pytest.raises(EngineConfigError, match="weights' dtype or fp8"):
        check_cpu_engine_config(VllmSettings(kv_cache_dtype="bfloat16"), TINY_FP32)
    long = replace(TINY_FP32, max_position_embeddings=1 << 21)
    with pytest.raises(EngineConfigError, match="max_model_len to at most 1048576"):
        check_cpu_engine_config(VllmSettings(kv_cache_dtype="float32"), long)
    with pytest.raises(EngineConfigError, match="at least 1"):
        check_cpu_engine_config(VllmSettings(kv_cache_dtype="float32", cpu_kv_cache_bytes=GIB // 2), TINY_FP32)


def test_cpu_engine_args_size_the_kv_cache_in_bytes_and_never_ask_for_sleep_mode(model_dir):
    settings = VllmSettings(kv_cache_dtype="float32", sleep_on_standby=True)
    plan = check_cpu_engine_config(settings, TINY_FP32)
    args = engine_args(model_dir, "tiny", settings, plan, replace(API, platform="cpu"))
    assert args["kv_cache_memory_bytes"] == GIB and "gpu_memory_utilization" not in args
    assert args["enable_sleep_mode"] is False


def test_kv_fragmentation_is_the_empty_share_of_allocated_blocks():
    # 1000 blocks of 128 tokens; 2 % in use = 20 blocks = 2560 slots, 640 of them holding tokens.
    assert kv_fragmentation(0.02, 128_000, 128, held_tokens=640) == pytest.approx(0.75)
    assert kv_fragmentation(0.0, 128_000, 128, held_tokens=0) is None
    assert kv_fragmentation(0.5, 128_000, None, held_tokens=10) is None
    # Prefix sharing can make held tokens exceed the allocated slots: never below zero.
    assert kv_fragmentation(0.001, 128_000, 128, held_tokens=1000) == 0.0
