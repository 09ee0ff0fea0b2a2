"""What an engine serving SmolLM2-135M-Instruct must show, shared by the torch and vLLM tiers:
greedy tokens equal to transformers' own implementation, a resumed stream that continues
exactly (greedy and seeded, cut at three points), and guided JSON that parses and conforms.

A test module subclasses `SmolLM2Cases` and provides an `engine` fixture (module scope) for
the `smollm2_model_dir` folder; generations are short, a decode step costs tens of ms here.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.common.generation import FinishReason, Sampling
from services.worker.engine import EngineRequest

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
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def chat_ids(smollm2_model_dir):
    """Renders messages with the model's chat template and tokenizes them (transformers)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(smollm2_model_dir))
    template = (smollm2_model_dir / "chat_template.jinja").read_text()

    def render(messages):
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text).input_ids

    return render


async def generate(engine, prompt_ids, generated=(), response_format="", **sampling):
    sampling.setdefault("temperature", 0.0)
    request = EngineRequest(
        "smollm2", tuple(prompt_ids), tuple(generated), Sampling(**sampling), response_format=response_format
    )
    tokens, text, finish = [], "", None
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        text += delta.text
        finish = delta.finish_reason
    return tokens, text, finish


class SmolLM2Cases:
    async def test_greedy_tokens_equal_transformers(self, engine, smollm2_model_dir, chat_ids):
        import torch
        from transformers import LlamaForCausalLM

        prompt = chat_ids(QUESTION)
        tokens, text, _ = await generate(engine, prompt, max_tokens=12)
        model = LlamaForCausalLM.from_pretrained(str(smollm2_model_dir), dtype=torch.float32)
        with torch.no_grad():
            reference = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        expected = [t for t in reference.tolist() if t != 2][: len(tokens)]  # EOS (<|im_end|>) is never emitted
        assert tokens == expected
        assert "Paris" in text  # a trained model: the answer means something

    @pytest.mark.parametrize(
        "sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"]
    )
    async def test_resumed_stream_continues_exactly(self, engine, chat_ids, sampling):
        prompt = chat_ids([{"role": "user", "content": "Name three colours of the rainbow."}])
        whole, _, _ = await generate(engine, prompt, max_tokens=16, **sampling)
        for cut in (1, len(whole) // 2, len(whole) - 1):
            rest, _, _ = await generate(engine, prompt, whole[:cut], max_tokens=16 - cut, **sampling)
            assert whole[:cut] + rest == whole, cut

    async def test_guided_json_is_valid(self, engine, chat_ids):
        prompt = chat_ids(
            [{"role": "user", "content": "Order 4521 was shipped to Lyon. Reply with JSON: order_id, status, city."}]
        )
        _, text, finish = await generate(engine, prompt, response_format=json.dumps(ORDER_SCHEMA), max_tokens=48)
        assert finish is FinishReason.STOP, text  # the document ended on its own, not cut by max_tokens
        jsonschema.validate(json.loads(text), ORDER_SCHEMA)
