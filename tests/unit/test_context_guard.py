"""The context guard: an over-long prompt is refused when no worker would count it, with the
tokenizer last learnt for the model; nothing is counted twice while a worker is routable."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.errors import InvalidArgument
from services.common.generation import Sampling
from services.router.context.guard import ContextGuard
from services.router.requests import InferenceRequest, Message
from services.router.tokenization import ModelTokenizer


class WordTokenizer:
    """One token per word: ModelTokenizer's counting, without a model."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self.encoded = 0

    def encode(self, request) -> list[int]:
        self.encoded += 1
        text = request.prompt if request.prompt is not None else " ".join(m.content for m in request.messages)
        return list(range(len(text.split())))

    check_fits = ModelTokenizer.check_fits


def request(words: int, *, prompt: bool = True, max_tokens: int = 8) -> InferenceRequest:
    text = " ".join(["charger"] * words)
    base = InferenceRequest(
        request_id="r", session_id="", tenant="t", model="tiny", sampling=Sampling(max_tokens=max_tokens), tier="A"
    )
    if prompt:
        return replace(base, prompt=text)
    return replace(base, messages=(Message("system", "be brief"), Message("user", text)))


def guard(tokenizer, routable: bool = False) -> ContextGuard:
    return ContextGuard(lambda model: tokenizer if model == "tiny" else None, lambda model: routable)


@pytest.mark.parametrize("prompt", [True, False])
async def test_over_the_context_with_no_worker_is_invalid_argument(prompt):
    with pytest.raises(InvalidArgument) as refused:
        await guard(WordTokenizer(100)).check(request(95, prompt=prompt))
    assert "context of 100 tokens" in refused.value.message


async def test_a_prompt_that_fits_passes():
    await guard(WordTokenizer(100)).check(request(90))


async def test_a_routable_worker_counts_it_itself():
    tokenizer = WordTokenizer(100)
    await guard(tokenizer, routable=True).check(request(500))
    assert tokenizer.encoded == 0


async def test_a_model_never_learnt_goes_on_uncounted():
    await guard(None).check(request(500))


async def test_a_big_prompt_is_counted_too():
    with pytest.raises(InvalidArgument):
        await guard(WordTokenizer(1000)).check(request(20_000))
