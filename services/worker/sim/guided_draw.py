"""JSON Schema answers from the sim engine: deterministic tokens that the grammar allows.

A sim worker given a `response_format` draws under the grammar the torch engine masks with
(`services.worker.guided`): a token the grammar forces is taken; otherwise ids drawn from
(seed, prompt, position, attempt) are tried in turn until one fits. On about one step in
four the ids that close something (a quote, a brace, a bracket, a comma) are tried first, so
strings and numbers stay short and a document ends within a few dozen tokens, as a trained
model's does. Where the document is already complete but could go on (the digits of a
top-level number), such a step draws the EOS; so does any step where no ordinary id fits. The
engine ends the answer by `guided.document_end`, as every engine does. The draws depend on
the position alone and a resumed stream's grammar is fast-forwarded over the ids already
sent, so a guided stream resumed anywhere continues exactly.
"""

from __future__ import annotations

from typing import Sequence

from services.worker.guided import JsonGuide
from services.worker.sim.tokens import TokenSource, draw

# Draws tried before every ordinary id is tried in order.
_DRAWS = 64
_CLOSING = ('"', "}", "]", ",")
# One step in this many tries the closing ids first.
_CLOSE_EVERY = 4


class GuidedDraw:
    def __init__(self, tokens: TokenSource, texts: Sequence[str]) -> None:
        """`texts`: each ordinary id's decoded text, in `tokens.ordinary_ids` order."""
        self._tokens = tokens
        self._ordinary = tokens.ordinary_ids
        self._closing = [i for i, text in zip(self._ordinary, texts) if any(c in text for c in _CLOSING)]

    def next_token(self, guide: JsonGuide, seed: int, prompt_key: bytes, position: int) -> int:
        """The next id: the guide's first EOS id when the answer ends here."""
        forced = guide.forced_tokens()
        if forced:
            return forced[0]
        number = draw(seed, prompt_key, position)
        eos = guide.eos_token_ids[0]
        if number % _CLOSE_EVERY == 0 and guide.accepting:
            return eos
        if self._closing and number % _CLOSE_EVERY == 0:
            start = number // _CLOSE_EVERY
            for k in range(len(self._closing)):
                token = self._closing[(start + k) % len(self._closing)]
                if guide.accepts(token):
                    return token
        for attempt in range(_DRAWS):
            token = self._tokens.token(seed, prompt_key, position, attempt)
            if guide.accepts(token):
                return token
        return next((token for token in self._ordinary if guide.accepts(token)), eos)
