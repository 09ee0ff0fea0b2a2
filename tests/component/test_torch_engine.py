"""The torch engine on the tiny model: exact greedy decoding, seeded and resumable sampling,
concurrency, cancellation, admission bounds and input validation."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from services.common.errors import InvalidArgument, ResourceExhausted
from services.worker.engine import EngineRequest, FinishReason, Sampling, TokenDelta
from services.worker.tiny_model import render_chat
from services.worker.torch.engine import TorchEngine
from tests.model_fixtures import tiny_model_dir  # noqa: F401

CHAT = render_chat([{"role": "user", "content": "Where is my order 12345?"}], add_generation_prompt=True)
CHAT_ZH = render_chat([{"role": "user", "content": "可以用支付宝付款吗？"}], add_generation_prompt=True)
RAW = "The customer paid for the winter coat"


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    deltas: list[TokenDelta] = field(default_factory=list)


async def run(engine: TorchEngine, prompt: str | list[int], generated: list[int] | tuple = (), **sampling) -> Result:
    ids = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
    sampling.setdefault("temperature", 0.0)
    request = EngineRequest("r", tuple(ids), tuple(generated), Sampling(**sampling))
    result = Result()
    async for delta in engine.generate(request):
        assert result.finish is None, "delta after the finishing one"
        result.deltas.append(delta)
        result.tokens += delta.token_ids
        result.text += delta.text
        result.finish = delta.finish_reason
    assert result.finish is not None
    return result


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(tiny_model_dir):
    e = TorchEngine(tiny_model_dir, "tiny", max_concurrency=4)
    await e.start()
    yield e
    await e.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def endless(tiny_model_dir):
    """EOS disabled, so every run lasts exactly max_tokens."""
    e = TorchEngine(tiny_model_dir, "tiny", max_concurrency=4, eos_token_ids=())
    await e.start()
    yield e
    await e.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()


def assert_idle(engine: TorchEngine) -> None:
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_tokens) == (0, 0, 0), stats


async def test_describes_the_model(engine, tiny_model_dir):
    model = engine.model
    assert model.name == "tiny" and model.max_context == 2048
    assert model.eos_token_ids == (3, 1)
    assert engine.tokenize("<|im_start|>hi") == [2, *engine.tokenize("hi")]
    stats = engine.stats()
    assert stats.kv_capacity_tokens == 4 * 2048 and stats.kv_used == 0


@pytest.mark.parametrize("prompt", [CHAT, CHAT_ZH, RAW])
async def test_greedy_matches_transformers_generate(engine, hf_model, prompt):
    ids = engine.tokenize(prompt)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    ended_by_eos = expected[-1] in (1, 3)
    if ended_by_eos:
        expected = expected[:-1]  # the engine never emits the EOS token itself
    got = await run(engine, ids, max_tokens=40)
    assert got.tokens == expected
    assert got.finish == (FinishReason.STOP if ended_by_eos else FinishReason.LENGTH)
    assert got.text == engine._tokenizer.decode(got.tokens, skip_special_tokens=True)
    assert_idle(engine)


async def test_greedy_without_eos_matches_a_full_recompute_loop(endless, hf_model):
    ids = endless.tokenize(CHAT_ZH)
    expected: list[int] = []
    with torch.inference_mode():
        for _ in range(48):  # no KV cache: an independent path through the model
            logits = hf_model(input_ids=torch.tensor([ids + expected])).logits[0, -1]
            expected.append(int(logits.argmax()))
    got = await run(endless, ids, max_tokens=48)
    assert got.tokens == expected and got.finish == FinishReason.LENGTH


async def test_chat_answer_ends_at_eos_without_emitting_it(engine):
    got = await run(engine, CHAT, max_tokens=60)
    assert got.finish == FinishReason.STOP and 0 < len(got.tokens) < 60
    assert not set(got.tokens) & {1, 3}
    assert got.deltas[-1].token_ids == []  # the EOS step only closes the stream
    assert "order" in got.text


async def test_eos_override_stops_at_that_token(tiny_model_dir, endless):
    reference = await run(endless, RAW, max_tokens=30)
    stop_token = reference.tokens[6]
    first = reference.tokens.index(stop_token)
    e = TorchEngine(tiny_model_dir, "tiny", eos_token_ids=[stop_token])
    await e.start()
    try:
        got = await run(e, RAW, max_tokens=30)
    finally:
        await e.stop()
    assert got.tokens == reference.tokens[:first] and got.finish == FinishReason.STOP


async def test_plain_prompt_runs_to_max_tokens_with_eos_enabled(engine):
    # Other suites rely on this: long streams come from prompts without the chat template.
    got = await run(engine, "Where is my order? I paid for a blue phone case yesterday.", max_tokens=300)
    assert len(got.tokens) == 300 and got.finish == FinishReason.LENGTH


async def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir, endless):
    prompt = CHAT_ZH + RAW  # longer than several chunks
    reference = await run(endless, prompt, max_tokens=24)
    e = TorchEngine(tiny_model_dir, "tiny", eos_token_ids=(), prefill_chunk=8)
    await e.start()
    try:
        got = await run(e, prompt, max_tokens=24)
        assert got.tokens == reference.tokens
        resumed = await run(e, prompt, generated=reference.tokens[:10], max_tokens=14)
        assert resumed.tokens == reference.tokens[10:]
    finally:
        await e.stop()


async def test_the_transformers_runtime_gives_the_native_tokens(tiny_model_dir, endless):
    """The fallback path (any model the plain-torch decoder does not cover) starts, warm-up
    pass included, and decodes exactly what the native decoder does."""
    reference = await run(endless, CHAT, max_tokens=16)
    e = TorchEngine(tiny_model_dir, "tiny", eos_token_ids=(), runtime="transformers")
    await e.start()
    try:
        got = await run(e, CHAT, max_tokens=16)
        assert got.tokens == reference.tokens
        resumed = await run(e, CHAT, generated=reference.tokens[:6], max_tokens=10)
        assert resumed.tokens == reference.tokens[6:]
    finally:
        await e.stop()


async def test_a_step_whose_stream_was_released_fails_alone(endless):
    """A stream cancelled while its decode step waits for the compute thread releases its cache;
    that step is answered with an error and its batch-mates still get their tokens."""
    from services.common.errors import Unavailable
    from services.worker.torch.step_scheduler import DecodeStep
    from services.worker.torch.engine import _Sequence

    reference = await run(endless, RAW, max_tokens=2)
    live = _Sequence()
    prompt = endless.tokenize(RAW)
    _logits, (live.cache,) = endless._runner.prefill_many([None], [prompt])
    released = _Sequence()  # cache None: what the stream's cleanup leaves
    steps = [
        DecodeStep(2, 0, released, reference.tokens[0], None),
        DecodeStep(2, 1, live, reference.tokens[0], (Sampling(max_tokens=2, temperature=0.0), 0, 1, None)),
    ]
    results = await endless._steps.call(endless._decode_batch, steps)
    assert isinstance(results[0], Unavailable)
    assert results[1] == reference.tokens[1]


async def test_max_tokens_is_respected(endless):
    for n in (1, 5, 33):
        got = await run(endless, RAW, max_tokens=n)
        assert len(got.tokens) == n and got.finish == FinishReason.LENGTH
        assert [len(d.token_ids) for d in got.deltas] == [1] * n


async def test_zero_max_tokens_finishes_at_once(endless):
    got = await run(endless, RAW, max_tokens=0)
    assert got.tokens == [] and got.finish == FinishReason.LENGTH
    assert_idle(endless)


async def test_seeded_sampling_is_reproducible(endless):
    a = await run(endless, CHAT_ZH, max_tokens=40, temperature=1.3, top_p=0.95, seed=1234)
    b = await run(endless, CHAT_ZH, max_tokens=40, temperature=1.3, top_p=0.95, seed=1234)
    c = await run(endless, CHAT_ZH, max_tokens=40, temperature=1.3, top_p=0.95, seed=99)
    assert a.tokens == b.tokens and a.text == b.text
    assert c.tokens != a.tokens
    unseeded = [await run(endless, CHAT_ZH, max_tokens=40, temperature=1.3) for _ in range(2)]
    assert unseeded[0].tokens != unseeded[1].tokens


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.5, "top_p": 0.9, "seed": 7},
        {"temperature": 2.0, "seed": 8},
    ],
)
async def test_resume_from_generated_ids_continues_the_same_stream(endless, sampling):
    n = 40
    full = await run(endless, CHAT_ZH, max_tokens=n, **sampling)
    for k in (1, 3, 17, n - 1, n):
        sent_text = "".join(d.text for d in full.deltas[:k])
        resumed = await run(endless, CHAT_ZH, generated=full.tokens[:k], max_tokens=n - k, **sampling)
        assert resumed.tokens == full.tokens[k:], k
        assert sent_text + resumed.text == full.text, k
        assert resumed.finish == FinishReason.LENGTH
    assert_idle(endless)


@pytest.mark.parametrize("prompt", [CHAT, CHAT_ZH, RAW])
async def test_streamed_text_concatenates_to_decode(endless, prompt):
    # High temperature picks stray byte tokens too, so characters split across tokens.
    got = await run(endless, prompt, max_tokens=60, temperature=3.0, seed=3)
    assert got.text == endless._tokenizer.decode(got.tokens, skip_special_tokens=True)


async def test_stop_string_ends_the_stream_before_it(endless):
    full = await run(endless, CHAT, max_tokens=40)
    stop = full.text[12:16]
    cut = full.text.index(stop)
    got = await run(endless, CHAT, max_tokens=40, stop=(stop, "never-appears"))
    assert got.finish == FinishReason.STOP
    assert got.text == full.text[:cut]
    assert got.tokens == full.tokens[: len(got.tokens)] and len(got.tokens) < 40


async def test_concurrent_sequences_match_sequential(endless):
    requests = [
        (CHAT, {"temperature": 0.0}),
        (CHAT_ZH, {"temperature": 1.2, "seed": 5}),
        (RAW, {"temperature": 0.8, "top_p": 0.9, "seed": 6}),
        (RAW, {"temperature": 0.0}),
        (CHAT_ZH, {"temperature": 0.0}),
    ]
    # Answers long enough that the four run side by side for many samples of the watcher,
    # on a machine much faster than this one too.
    sequential = [await run(endless, p, max_tokens=150, **s) for p, s in requests]
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            stats = endless.stats()
            peak = max(peak, stats.running)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    concurrent = await asyncio.gather(*(run(endless, p, max_tokens=150, **s) for p, s in requests))
    watcher.cancel()
    assert [r.tokens for r in concurrent] == [r.tokens for r in sequential]
    assert [r.text for r in concurrent] == [r.text for r in sequential]
    assert peak == 4  # max_concurrency, with the fifth one waiting
    assert_idle(endless)


async def test_aclose_frees_the_slot_and_kv(endless):
    stream = endless.generate(EngineRequest("c", tuple(endless.tokenize(RAW)), (), Sampling(max_tokens=200)))
    for _ in range(3):
        await stream.__anext__()
    stats = endless.stats()
    assert stats.running == 1 and stats.kv_tokens > len(endless.tokenize(RAW))
    await stream.aclose()
    assert_idle(endless)


async def test_cancelling_the_consumer_frees_the_slot_and_reraises(endless):
    started = asyncio.Event()

    async def consume():
        async for _ in endless.generate(
            EngineRequest("c", tuple(endless.tokenize(RAW)), (), Sampling(max_tokens=1000))
        ):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_idle(endless)


async def test_waiting_requests_are_counted_and_bounded(tiny_model_dir):
    e = TorchEngine(tiny_model_dir, "tiny", max_concurrency=1, max_waiting=1, eos_token_ids=())
    await e.start()
    request = EngineRequest("w", tuple(e.tokenize(RAW)), (), Sampling(max_tokens=50))
    try:
        holder = e.generate(request)
        await holder.__anext__()
        waiter = asyncio.create_task(e.generate(request).__anext__())
        await asyncio.sleep(0.05)
        assert (e.stats().running, e.stats().waiting) == (1, 1)
        with pytest.raises(ResourceExhausted):
            await e.generate(request).__anext__()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert e.stats().waiting == 0
        await holder.aclose()
        assert_idle(e)
        # Once the slot is free, a request runs again.
        assert len((await run(e, RAW, max_tokens=3)).tokens) == 3
    finally:
        await e.stop()


@pytest.mark.parametrize(
    "prompt, generated, sampling, match",
    [
        ([], (), {}, "prompt is empty"),
        ([5, 512], (), {}, "outside the vocabulary"),
        ([5, -1], (), {}, "outside the vocabulary"),
        ([5], (600,), {}, "outside the vocabulary"),
        ([5] * 2000, (), {"max_tokens": 49}, "exceeds the model's context"),
        ([5] * 2000, (6,) * 40, {"max_tokens": 9}, "exceeds the model's context"),
        ([5], (), {"max_tokens": -1}, "max_tokens"),
        ([5], (), {"temperature": -0.5}, "temperature"),
        ([5], (), {"temperature": float("nan")}, "temperature"),
        ([5], (), {"top_p": 0.0}, "top_p"),
        ([5], (), {"top_p": 1.5}, "top_p"),
        ([5], (), {"stop": ("",)}, "stop"),
    ],
)
async def test_invalid_requests_are_rejected(engine, prompt, generated, sampling, match):
    sampling.setdefault("max_tokens", 4)
    request = EngineRequest("bad", tuple(prompt), tuple(generated), Sampling(**sampling))
    with pytest.raises(InvalidArgument, match=match):
        async for _ in engine.generate(request):
            pass
    assert_idle(engine)


async def test_context_limit_is_inclusive(endless):
    got = await run(endless, [5] * 2040, generated=[6] * 4, max_tokens=4)
    assert len(got.tokens) == 4


async def test_concurrent_sequences_decode_in_pool_slots_that_all_come_back(endless):
    """The native runner keeps each running sequence's KV in a pool slot (batched attention);
    when the sequences end, every slot is free again (none leaks to a finished stream)."""
    import gc

    pool = endless._runner._model.pool
    assert pool is not None and pool.slots >= 2 * 4
    seen_taken = []

    async def watch() -> None:
        while True:
            seen_taken.append(pool.slots - pool.free)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*(run(endless, CHAT, max_tokens=120) for _ in range(8)))
    finally:
        watcher.cancel()
    assert all(len(r.tokens) == 120 for r in results)
    assert len({tuple(r.tokens) for r in results}) == 1  # greedy: one answer, batched or not
    assert max(seen_taken) >= 2  # sequences ran side by side in slots
    gc.collect()
    assert pool.free == pool.slots
    assert_idle(endless)
