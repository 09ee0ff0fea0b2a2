"""What every engine behind `services.worker.engine.Engine` must do, as one reusable suite.

A test module picks engines and a model and subclasses `EngineConformance`:

    from tests.engine_conformance import conf_engine, endless  # the engines under test

    engine_factory = factory_fixture(torch_factory())

    @pytest.fixture(scope="module")
    def conformance_model_dir(tiny_model_dir):
        return tiny_model_dir

    class TestTorchConformance(EngineConformance):
        pass

The suite checks streams (delta shape, exact max_tokens, text that concatenates to the
decoded tokens), greedy and seeded determinism, resuming from generated ids (greedy exactly;
seeded exactly where the engine can, reproducibly everywhere), stop strings (also one already
reached before the resume point), EOS never emitted, abort on close and on cancellation,
typed errors for bad input, and guided decoding by the rules of `services.worker.guided`: a
complete document that conforms (with EOS on or off), resumed ids that break the schema
refused, a document cut by max_tokens that the router's repair step closes, and a resumed
guided stream that continues the document exactly. It uses only the Engine protocol, the
model's tokenizer.json and plain-text prompts, so it runs unchanged on the tiny model on CPU
and on a real model on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jsonschema
import pytest
import pytest_asyncio

from services.common.errors import InvalidArgument
from services.router.structured import Status, check_schema, repair
from services.worker.engine import Engine, EngineRequest, FinishReason, Sampling, TokenDelta

PROSE = "The customer paid for the winter coat with a credit card and asked when it ships"
OTHER = "Support answered the question about the running shoes"

# Every document of this schema is short (a bounded integer, an enum, a string of at most 12
# characters), so a stream that follows its grammar completes one within GUIDED_BUDGET tokens
# however weak the model: the guided cases hold on the untrained tiny model too.
ORDER_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "order": {"type": "integer", "minimum": 1, "maximum": 9999},
            "status": {"type": "string", "enum": ["shipped", "late"]},
            "note": {"type": "string", "maxLength": 12},
        },
        "required": ["order", "status", "note"],
        "additionalProperties": False,
    }
)
GUIDED_PROMPT = "Reply in JSON about order 7041:"
GUIDED_BUDGET = 128


@dataclass(frozen=True)
class EngineFactory:
    """Builds an engine (not started) over a model folder. `eos_token_ids=()` must disable
    EOS, so streams last exactly max_tokens."""

    name: str
    make: Callable[..., Engine]
    # Whether a resumed seeded stream continues with exactly the tokens of the uninterrupted
    # one (position-seeded sampling); otherwise it must at least be reproducible.
    exact_seeded_resume: bool = True
    # How long stats may lag behind a closed stream (engines whose stats arrive with steps).
    idle_timeout_s: float = 2.0


def factory_fixture(*factories: EngineFactory):
    """A module-scoped `engine_factory` fixture parametrized over `factories`."""

    @pytest.fixture(scope="module", params=factories, ids=[f.name for f in factories])
    def engine_factory(request):
        return request.param

    return engine_factory


def torch_factory(device: str = "auto", name: str = "torch") -> EngineFactory:
    def make(model_dir: Path, eos_token_ids: Sequence[int] | None = None, max_concurrency: int = 4) -> Engine:
        from services.worker.torch.engine import TorchEngine

        return TorchEngine(
            model_dir, "conformance", max_concurrency=max_concurrency, device=device, eos_token_ids=eos_token_ids
        )

    return EngineFactory(name, make)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    deltas: list[TokenDelta] = field(default_factory=list)

    def text_before(self, k: int) -> str | None:
        """Text the client had once the first `k` tokens arrived; None when no delta ends
        exactly at token k (an engine may send several tokens per delta)."""
        count, text = 0, ""
        if k == 0:
            return text
        for delta in self.deltas:
            count += len(delta.token_ids)
            text += delta.text
            if count >= k:
                # The finishing delta also releases held-back text, which a replica that
                # died before finishing never sent.
                return text if count == k and delta.finish_reason is None else None
        return None


async def run(
    engine: Engine,
    prompt: str | Sequence[int],
    generated: Sequence[int] = (),
    response_format: str = "",
    **sampling: Any,
) -> Result:
    ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    sampling.setdefault("temperature", 0.0)
    request = EngineRequest(
        "conformance", tuple(ids), tuple(generated), Sampling(**sampling), response_format=response_format
    )
    result = Result()
    async for delta in engine.generate(request):
        assert result.finish is None, "a delta after the finishing one"
        result.deltas.append(delta)
        result.tokens += delta.token_ids
        result.text += delta.text
        result.finish = delta.finish_reason
    assert result.finish is not None, "the stream ended without a finish reason"
    return result


def decoder(engine: Engine):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(engine.model.tokenizer_json.decode("utf-8"))


async def wait_idle(engine: Engine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.01)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def conf_engine(engine_factory, conformance_model_dir):
    engine = engine_factory.make(conformance_model_dir)
    await engine.start()
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def endless(engine_factory, conformance_model_dir):
    """EOS disabled: every stream lasts exactly max_tokens."""
    engine = engine_factory.make(conformance_model_dir, eos_token_ids=())
    await engine.start()
    yield engine
    await engine.stop()


class EngineConformance:
    """The suite. The test module provides `engine_factory` and `conformance_model_dir`
    fixtures and imports `conf_engine` and `endless` from here."""

    # --- the model ---------------------------------------------------------------------
    async def test_describes_the_model(self, conf_engine):
        model = conf_engine.model
        assert model.name and model.version and model.max_context > 0
        assert model.tokenizer_json and isinstance(model.eos_token_ids, tuple)
        ids = conf_engine.tokenize(PROSE)
        assert ids and all(isinstance(i, int) and i >= 0 for i in ids)
        assert decoder(conf_engine).decode(ids, skip_special_tokens=True) == PROSE

    # --- streams -----------------------------------------------------------------------
    async def test_stream_shape_and_text(self, endless):
        prompt = endless.tokenize(PROSE)
        got = await run(endless, prompt, max_tokens=24)
        assert len(got.tokens) == 24 and got.finish == FinishReason.LENGTH
        assert got.text == decoder(endless).decode(got.tokens, skip_special_tokens=True)
        first = got.deltas[0].prefill_tokens
        assert first is None or 0 <= first <= len(prompt)
        assert all(d.prefill_tokens is None for d in got.deltas[1:])

    async def test_max_tokens_is_exact(self, endless):
        for n in (1, 7):
            got = await run(endless, PROSE, max_tokens=n)
            assert len(got.tokens) == n and got.finish == FinishReason.LENGTH

    async def test_zero_max_tokens_finishes_at_once(self, endless):
        got = await run(endless, PROSE, max_tokens=0)
        assert got.tokens == [] and got.finish == FinishReason.LENGTH

    async def test_eos_is_never_emitted(self, conf_engine):
        got = await run(conf_engine, OTHER, max_tokens=48, temperature=1.0, seed=11)
        assert not set(got.tokens) & set(conf_engine.model.eos_token_ids)

    # --- determinism ---------------------------------------------------------------------
    async def test_greedy_is_deterministic(self, endless):
        a = await run(endless, PROSE, max_tokens=24)
        b = await run(endless, PROSE, max_tokens=24)
        assert a.tokens == b.tokens and a.text == b.text

    async def test_seeded_sampling_is_reproducible(self, endless):
        options = {"max_tokens": 32, "temperature": 1.5, "top_p": 0.95}
        a = await run(endless, PROSE, seed=1234, **options)
        b = await run(endless, PROSE, seed=1234, **options)
        c = await run(endless, PROSE, seed=99, **options)
        assert a.tokens == b.tokens and a.text == b.text
        assert c.tokens != a.tokens
        unseeded = [await run(endless, PROSE, **options) for _ in range(2)]
        assert unseeded[0].tokens != unseeded[1].tokens

    # --- resume from generated ids ---------------------------------------------------------
    async def test_greedy_resume_continues_the_same_stream(self, endless):
        n = 32
        full = await run(endless, PROSE, max_tokens=n)
        for k in (1, 9, n - 1, n):
            resumed = await run(endless, PROSE, generated=full.tokens[:k], max_tokens=n - k)
            assert resumed.tokens == full.tokens[k:], k
            assert resumed.finish == FinishReason.LENGTH
            sent = full.text_before(k)
            if sent is not None:  # the text the client had, continued seamlessly
                assert sent + resumed.text == full.text, k

    async def test_seeded_resume(self, endless, engine_factory):
        n, k = 32, 10
        options = {"temperature": 1.3, "top_p": 0.9, "seed": 7}
        full = await run(endless, PROSE, max_tokens=n, **options)
        resumed = await run(endless, PROSE, generated=full.tokens[:k], max_tokens=n - k, **options)
        again = await run(endless, PROSE, generated=full.tokens[:k], max_tokens=n - k, **options)
        assert len(resumed.tokens) == n - k and resumed.tokens == again.tokens
        if engine_factory.exact_seeded_resume:
            assert resumed.tokens == full.tokens[k:]

    # --- stop strings ------------------------------------------------------------------------
    async def test_stop_string_ends_the_stream_before_it(self, endless):
        full = await run(endless, PROSE, max_tokens=40)
        stop = next(
            full.text[i : i + 3]
            for i in range(8, len(full.text) - 3)
            if "\ufffd" not in full.text[i : i + 3] and full.text[i : i + 3].strip()
        )
        got = await run(endless, PROSE, max_tokens=40, stop=(stop, "never-appears"))
        assert got.finish == FinishReason.STOP
        assert got.text == full.text[: full.text.index(stop)]
        assert got.tokens == full.tokens[: len(got.tokens)] and len(got.tokens) < 40

    async def test_stop_string_already_generated_finishes_at_once(self, endless):
        full = await run(endless, PROSE, max_tokens=24)
        stop = full.text[2:5]
        got = await run(endless, PROSE, generated=full.tokens, max_tokens=8, stop=(stop,))
        assert got.tokens == [] and got.finish == FinishReason.STOP

    # --- abort -----------------------------------------------------------------------------
    async def test_aclose_aborts_and_frees(self, endless, engine_factory):
        prompt = endless.tokenize(PROSE)
        long = min(500, endless.model.max_context - len(prompt))
        stream = endless.generate(EngineRequest("c", tuple(prompt), (), Sampling(max_tokens=long)))
        await stream.__anext__()
        await stream.__anext__()
        assert endless.stats().running + endless.stats().waiting >= 1
        await stream.aclose()
        await wait_idle(endless, engine_factory.idle_timeout_s)
        assert len((await run(endless, PROSE, max_tokens=3)).tokens) == 3

    async def test_cancelling_the_consumer_aborts_and_reraises(self, endless, engine_factory):
        started = asyncio.Event()

        async def consume():
            prompt = endless.tokenize(PROSE)
            long = min(1000, endless.model.max_context - len(prompt))
            request = EngineRequest("c", tuple(prompt), (), Sampling(max_tokens=long))
            async for _ in endless.generate(request):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(endless, engine_factory.idle_timeout_s)

    async def test_concurrent_greedy_streams_match_sequential(self, endless):
        prompts = [PROSE, OTHER, PROSE + " today"]
        sequential = [await run(endless, p, max_tokens=16) for p in prompts]
        concurrent = await asyncio.gather(*(run(endless, p, max_tokens=16) for p in prompts))
        assert [r.tokens for r in concurrent] == [r.tokens for r in sequential]

    # --- errors ----------------------------------------------------------------------------
    @pytest.mark.parametrize("case", ["empty", "vocabulary", "context", "max_tokens", "temperature", "top_p", "stop"])
    async def test_invalid_requests_are_rejected(self, conf_engine, engine_factory, case):
        prompt, generated, sampling = [5], (), {"max_tokens": 4}
        if case == "empty":
            prompt = []
        elif case == "vocabulary":
            prompt = [5, 1 << 30]
        elif case == "context":
            prompt = [5] * conf_engine.model.max_context
        else:
            sampling.update(
                {
                    "max_tokens": {"max_tokens": -1},
                    "temperature": {"temperature": -0.5},
                    "top_p": {"top_p": 0.0},
                    "stop": {"stop": ("",)},
                }[case]
            )
        request = EngineRequest("bad", tuple(prompt), generated, Sampling(**sampling))
        with pytest.raises(InvalidArgument):
            async for _ in conf_engine.generate(request):
                pass
        await wait_idle(conf_engine, engine_factory.idle_timeout_s)

    # --- guided decoding (response_format) ------------------------------------------------------
    async def guided(self, engine: Engine, generated: Sequence[int] = (), max_tokens: int = GUIDED_BUDGET) -> Result:
        return await run(
            engine,
            GUIDED_PROMPT,
            generated=generated,
            response_format=ORDER_SCHEMA,
            max_tokens=max_tokens - len(generated),
        )

    async def test_guided_answer_is_a_complete_document_of_the_schema(self, conf_engine, endless):
        got = await self.guided(conf_engine)
        assert got.finish == FinishReason.STOP and len(got.tokens) < GUIDED_BUDGET
        assert got.text == decoder(conf_engine).decode(got.tokens, skip_special_tokens=True)
        jsonschema.validate(json.loads(got.text), json.loads(ORDER_SCHEMA))
        assert not set(got.tokens) & set(conf_engine.model.eos_token_ids)
        # The document ends by the grammar, not by the engine's EOS setting: with EOS off the
        # stream is the same, and ends at the same token.
        without_eos = await self.guided(endless)
        assert (without_eos.tokens, without_eos.finish) == (got.tokens, got.finish)

    @pytest.mark.parametrize("sent", ["hello", '{"order":12,"colour"'], ids=["not-json", "unknown-property"])
    async def test_resumed_ids_that_break_the_schema_are_refused(self, conf_engine, engine_factory, sent):
        generated = conf_engine.tokenize(sent)
        with pytest.raises(InvalidArgument):
            await self.guided(conf_engine, generated=generated)
        await wait_idle(conf_engine, engine_factory.idle_timeout_s)
        await run(conf_engine, PROSE, max_tokens=2)  # and it still serves

    async def test_guided_answer_cut_by_max_tokens_is_a_prefix_the_router_can_repair(self, conf_engine):
        full = await self.guided(conf_engine)
        n = max(1, len(full.tokens) // 2)
        cut = await self.guided(conf_engine, max_tokens=n)
        assert cut.finish == FinishReason.LENGTH and cut.tokens == full.tokens[:n]
        assert full.text.startswith(cut.text)
        with pytest.raises(ValueError):
            json.loads(cut.text)
        schema = check_schema(ORDER_SCHEMA)
        repaired = repair(cut.text, schema)
        assert repaired.status is Status.REPAIRED, (cut.text, repaired.errors)
        jsonschema.validate(json.loads(repaired.text), json.loads(ORDER_SCHEMA))

    async def test_resumed_guided_stream_continues_the_document(self, conf_engine):
        full = await self.guided(conf_engine)
        n = len(full.tokens)
        for k in sorted({1, n // 2, n - 1, n}):
            resumed = await self.guided(conf_engine, generated=full.tokens[:k])
            assert full.tokens[:k] + resumed.tokens == full.tokens, k
            assert resumed.finish == FinishReason.STOP, k
            sent = full.text_before(k)
            if sent is not None:  # the text the client had, continued seamlessly
                assert sent + resumed.text == full.text, k
