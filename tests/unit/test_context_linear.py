"""fit_conversation's work is linear in the conversation: counted in tokens rendered across
every call to `encode` (no clock), for conversations of growing length that must be cut."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.errors import InvalidArgument
from services.router.context.window import ContextPolicy, fit_conversation


@dataclass(frozen=True)
class Msg:
    role: str
    content: str


class CountingEncode:
    """A template-like encoder (a BOS, a header per message, one token per word) that counts
    how many tokens it rendered in all."""

    def __init__(self) -> None:
        self.rendered = 0

    def __call__(self, messages) -> list[int]:
        ids = [0]
        for m in messages:
            ids += [1, 2] + [3] * len(m.content.split())
        self.rendered += len(ids)
        return ids


SYSTEM = "you help shoppers " * 100  # 300 words: a system prompt of a real size


def conversation(exchanges: int) -> list[Msg]:
    messages = [Msg("system", SYSTEM)]
    for i in range(exchanges):
        messages += [Msg("user", f"question {i} about item {i} please"), Msg("assistant", f"answer {i} is here")]
    messages.append(Msg("user", "and the item 3 price"))
    return messages


@pytest.mark.parametrize("policy", list(ContextPolicy)[1:])
def test_messages_rendered_grow_linearly_with_the_conversation(policy):
    work = []
    for exchanges in (100, 1000, 4000):
        encode = CountingEncode()
        messages = conversation(exchanges)
        whole = len(CountingEncode()(messages))
        fit = fit_conversation(messages, encode, max_context=800, max_tokens=32, policy=policy)
        assert fit.truncated and len(fit.prompt_ids) + 32 <= 800
        work.append(encode.rendered / whole)
    # Rendering system + latest + one exchange for each exchange costs the system prompt once
    # per exchange (about 40 times the conversation here). Now: the whole once, each exchange
    # alone once, and O(log n) selections that fit the context.
    assert max(work) < 4, work


def test_the_exact_correction_keeps_the_fewest_drops_that_fit():
    encode = CountingEncode()
    messages = conversation(50)
    fit = fit_conversation(messages, encode, max_context=600, max_tokens=32, policy=ContextPolicy.DROP_OLDEST)
    assert fit.truncated and len(fit.prompt_ids) + 32 <= 600
    # One more exchange (the newest dropped) would not have fit.
    newest_dropped = max(i for i in fit.dropped if messages[i].role == "user")
    kept = sorted([*fit.kept, newest_dropped, newest_dropped + 1])
    assert len(encode([messages[i] for i in kept])) + 32 > 600


def test_nothing_fits_is_still_an_invalid_argument():
    with pytest.raises(InvalidArgument):
        fit_conversation(conversation(10), CountingEncode(), max_context=200, max_tokens=32)
