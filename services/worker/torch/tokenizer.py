"""The worker's tokenizer, loaded without transformers where the model folder allows it.

A Hugging Face fast tokenizer is a `tokenizers.Tokenizer` (tokenizer.json) plus settings in
tokenizer_config.json. When those settings change nothing at encode or decode time, the
`tokenizers` object alone gives the same ids and text, and the worker skips importing
transformers (seconds of a cold start). Otherwise transformers' AutoTokenizer is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class FastTokenizer:
    """`tokenizers.Tokenizer` with the two calls the engine makes, as transformers spells them."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)


def load_tokenizer(model_dir: Path) -> Any:
    model_dir = Path(model_dir)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    plain = (
        (model_dir / "tokenizer.json").exists()
        and not config.get("clean_up_tokenization_spaces")
        and config.get("tokenizer_class", "PreTrainedTokenizerFast")
        in ("PreTrainedTokenizerFast", "Qwen2TokenizerFast")
    )
    if plain:
        from tokenizers import Tokenizer

        return FastTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
