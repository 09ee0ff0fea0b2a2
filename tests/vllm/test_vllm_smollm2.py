"""SmolLM2-135M-Instruct, a trained model, on the vLLM engine (vLLM's CPU build here): greedy
tokens equal to transformers', a resumed stream that continues exactly (greedy and seeded),
and guided JSON that parses and conforms to its schema.

One vLLM engine for the module (a start costs 30-80 s here); generations are short.
"""

from __future__ import annotations

import gc
import json

import jsonschema
import pytest
import pytest_asyncio

from tests.vllm.conftest import cpu_settings, require_vllm

require_vllm()

from services.common.generation import FinishReason  # noqa: E402
from services.worker.engine import EngineRequest, Sampling  # noqa: E402
from services.worker.vllm import VllmEngine  # noqa: E402
from tests.model_fixtures import smollm2_model_dir  # noqa: E402,F401  (fixture)

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

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


@pytest.fixture(scope="module")
def chat_ids(smollm2_model_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(smollm2_model_dir))
    template = (smollm2_model_dir / "chat_template.jinja").read_text()

    def render(messages):
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text).input_ids

    return render


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(smollm2_model_dir):
    engine = VllmEngine(smollm2_model_dir, "smollm2", cpu_settings(max_concurrency=4, max_model_len=2048))
    await engine.start()
    yield engine
    await engine.stop()
    # Collect vLLM's client now, while its modules are alive: its __del__ at interpreter exit
    # fails noisily on a half torn-down vLLM.
    gc.collect()


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
    import torch
    from transformers import LlamaForCausalLM

    prompt = chat_ids([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    tokens, text, _ = await generate(engine, prompt, max_tokens=12)
    model = LlamaForCausalLM.from_pretrained(str(smollm2_model_dir), dtype=torch.float32)
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    expected = [t for t in reference.tolist() if t != 2][:len(tokens)]  # EOS (<|im_end|>) is never emitted
    assert tokens == expected
    assert "Paris" in text


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}],
                         ids=["greedy", "seeded"])
async def test_resumed_stream_continues_exactly(engine, chat_ids, sampling):
    prompt = chat_ids([{"role": "user", "content": "Name three colours of the rainbow."}])
    whole, _, _ = await generate(engine, prompt, max_tokens=16, **sampling)
    for cut in (1, len(whole) // 2, len(whole) - 1):
        rest, _, _ = await generate(engine, prompt, whole[:cut], max_tokens=16 - cut, **sampling)
        assert whole[:cut] + rest == whole, cut


async def test_guided_json_is_valid(engine, chat_ids):
    prompt = chat_ids([{"role": "user", "content":
                        "Order 4521 was shipped to Lyon. Reply with JSON: order_id, status, city."}])
    _, text, finish = await generate(engine, prompt, response_format=json.dumps(ORDER_SCHEMA), max_tokens=48)
    assert finish is FinishReason.STOP, text
    jsonschema.validate(json.loads(text), ORDER_SCHEMA)
