"""Turns a request into prompt token ids with the model's own tokenizer and chat template.

The router fetches both from a worker's ModelInfo once per model version, so it counts
tokens exactly as the engine will, without loading any model weights. Both are linear in the
text; a big request renders and tokenizes on a thread (context.window.fit_request_async).
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from services.common.errors import InvalidArgument
from services.router.requests import InferenceRequest


# Texts at least this long (characters) are tokenized without holding the GIL.
GIL_FREE_CHARS = 4096


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@dataclass
class ModelTokenizer:
    """Tokenizer + chat template of one model version."""

    model_version: str
    max_context: int
    tokenizer: Tokenizer
    template: jinja2.Template
    bos_token: str
    eos_token: str

    @classmethod
    def from_model_info(cls, info) -> "ModelTokenizer":
        # Sandboxed: a chat template is data from a model folder, not trusted code.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        return cls(
            model_version=info.model_version,
            max_context=info.max_context,
            tokenizer=Tokenizer.from_str(info.tokenizer_json.decode()),
            template=env.from_string(info.chat_template),
            bos_token=info.bos_token,
            eos_token=info.eos_token,
        )

    def render(self, request: InferenceRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        try:
            return self.template.render(
                messages=[{"role": m.role, "content": m.content} for m in request.messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"conversation does not fit the model's chat template: {exc}") from None

    def encode(self, request: InferenceRequest) -> list[int]:
        text = self.render(request)
        # Raw prompts get the tokenizer's own special tokens (e.g. BOS); rendered chats
        # already carry them from the template.
        special = request.prompt is not None
        if len(text) < GIL_FREE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=special).ids
        # Only the batch call lets go of the GIL while it works, so a long prompt tokenized on
        # a thread does not hold the event loop (200k characters take a second or more); it
        # costs about a millisecond more per call, which a short text does not repay.
        return self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens"
            )
