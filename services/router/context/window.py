"""Fits a conversation into the model's context: prompt tokens + max_tokens <= max_context.

Tokens are counted with the model's own tokenizer and chat template (the router's
ModelTokenizer), so the count is the engine's. When a conversation does not fit, or has
more turns than `max_turns`, the request's policy decides:

- `error`: nothing is dropped; InvalidArgument with the counts.
- `drop_oldest`: earlier exchanges go, oldest first.
- `entity_aware` (default): the exchanges just before the latest one, and earlier ones that
  share entities or keywords with the latest user message (product names, numbers, ids,
  prices), stay; the others go first, oldest first, then the least related ones.

Every policy keeps the system messages and the latest exchange, and drops whole exchanges
(a user message with the answers after it), so the turns left still alternate as chat
templates require and no answer loses its question. The result says which message indices
were dropped, so the Finished event can report it.
"""

from __future__ import annotations

import asyncio
import enum
import math
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

from services.common.errors import InvalidArgument
from services.router.context.entities import overlap, terms

# A request with more text than this (characters) or more messages is fitted on a thread:
# rendering and tokenizing it can take longer than the event loop may be held.
OFF_LOOP_CHARS = 16 * 1024
OFF_LOOP_MESSAGES = 64

# Exchanges just before the latest one that entity_aware drops last: a follow-up ("is it
# available in white?") needs them without naming anything in them.
RECENT_EXCHANGES = 1


class ChatMessage(Protocol):
    role: str
    content: str


Encode = Callable[[Sequence[ChatMessage]], list[int]]


class ContextPolicy(str, enum.Enum):
    ERROR = "error"
    DROP_OLDEST = "drop_oldest"
    ENTITY_AWARE = "entity_aware"

    @classmethod
    def parse(cls, name: str) -> "ContextPolicy":
        """The policy named by a request; empty means the default (entity_aware)."""
        if not name:
            return cls.ENTITY_AWARE
        try:
            return cls(name)
        except ValueError:
            raise InvalidArgument(
                f"unknown context policy {name!r}; use one of {', '.join(p.value for p in cls)}"
            ) from None


@dataclass(frozen=True)
class ContextFit:
    """The conversation as it will be sent, and what was left out of it."""

    messages: tuple
    prompt_ids: tuple[int, ...]
    policy: ContextPolicy
    # Indices into the original messages, ascending.
    kept: tuple[int, ...]
    dropped: tuple[int, ...] = ()
    # Tokens of the whole conversation before anything was dropped.
    original_tokens: int = 0

    @property
    def truncated(self) -> bool:
        return bool(self.dropped)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def fit_conversation(
    messages: Sequence[ChatMessage],
    encode: Encode,
    *,
    max_context: int,
    max_tokens: int,
    policy: ContextPolicy = ContextPolicy.ENTITY_AWARE,
    max_turns: int | None = None,
    recent_exchanges: int = RECENT_EXCHANGES,
) -> ContextFit:
    """Chooses the messages to send; `encode` renders messages with the chat template and
    returns their token ids. Raises InvalidArgument when the policy cannot make it fit."""
    if max_turns is not None and max_turns < 1:
        raise InvalidArgument("max_turns must be at least 1")
    system = [i for i, m in enumerate(messages) if m.role == "system"]
    units = _exchanges(messages)
    turns = sum(len(u) for u in units)
    ids = encode(messages)
    over_turns = max_turns is not None and turns > max_turns
    if len(ids) + max_tokens <= max_context and not over_turns:
        everything = tuple(range(len(messages)))
        return ContextFit(tuple(messages), tuple(ids), policy, everything, (), len(ids))
    if policy is ContextPolicy.ERROR:
        if over_turns:
            raise InvalidArgument(
                f"conversation has {turns} turns; max_turns is {max_turns} (context policy 'error' drops nothing)"
            )
        raise InvalidArgument(
            f"conversation is {len(ids)} tokens; with max_tokens {max_tokens} that exceeds the model's "
            f"context of {max_context} tokens (context policy 'error' drops nothing; use drop_oldest "
            "or entity_aware, or send fewer turns)"
        )
    original_tokens = len(ids)
    latest, earlier = (units[-1] if units else []), units[:-1]
    order = _drop_order(messages, earlier, latest, policy, recent_exchanges)  # positions in `earlier`

    def pick(kept: Sequence[int]) -> list:
        return [messages[i] for i in _indices(system, latest, earlier, kept)]

    # Estimate each exchange's tokens and drop by the estimates; exact counts of the final
    # selection then correct template or merge effects at the boundaries. Every step is linear
    # in the conversation (a request of thousands of turns must not cost thousands of renders
    # of the whole prompt): one render of each exchange alone, and O(log n) exact renders.
    base = len(encode(pick([])))
    cost = _exchange_costs(messages, earlier, encode, len(ids) - base)
    estimate = base + sum(cost)
    kept_turns = turns

    def over_estimate() -> bool:
        return estimate + max_tokens > max_context or (max_turns is not None and kept_turns > max_turns)

    dropped = 0
    while dropped < len(order) and over_estimate():
        k = order[dropped]
        dropped += 1
        estimate -= cost[k]
        kept_turns -= len(earlier[k])

    def attempt(count: int) -> tuple[list, list[int], list[int]]:
        kept = sorted(set(range(len(earlier))) - set(order[:count]))
        chosen = pick(kept)
        return chosen, encode(chosen), kept

    chosen, ids, kept = attempt(dropped)
    if len(ids) + max_tokens > max_context:
        # Drop more, in the same order: the fewest further exchanges that make it fit, found by
        # bisection over exact counts (dropping more never adds tokens).
        low, high = dropped + 1, len(order)
        chosen, ids, kept = attempt(high)
        if len(ids) + max_tokens > max_context:
            raise InvalidArgument(
                f"the system prompt and the latest turn alone are {len(ids)} tokens; with max_tokens "
                f"{max_tokens} that exceeds the model's context of {max_context} tokens"
            )
        while low < high:
            middle = (low + high) // 2
            trial = attempt(middle)
            if len(trial[1]) + max_tokens <= max_context:
                high, (chosen, ids, kept) = middle, trial
            else:
                low = middle + 1
    kept_idx = _indices(system, latest, earlier, kept)
    dropped_idx = tuple(sorted(set(range(len(messages))) - set(kept_idx)))
    return ContextFit(tuple(chosen), tuple(ids), policy, kept_idx, dropped_idx, original_tokens)


def _exchange_costs(messages: Sequence[ChatMessage], earlier: list[list[int]], encode: Encode, total: int) -> list[int]:
    """Estimated tokens each earlier exchange adds to the prompt, `total` for all of them.

    Each exchange is rendered alone; what such a render adds besides the exchange (a BOS, a
    default system prompt, the generation prompt) is the same for each, so it is taken out
    evenly: the estimates then add up to `total`. A template that refuses an exchange alone
    (it must start the conversation, say) gets shares of `total` by characters instead.
    """
    if not earlier:
        return []
    try:
        alone = [len(encode([messages[i] for i in unit])) for unit in earlier]
    except InvalidArgument:
        chars = [sum(len(messages[i].content) + 1 for i in unit) for unit in earlier]
        whole = sum(chars)
        return [total * c / whole for c in chars]
    overhead = (sum(alone) - total) / len(earlier)
    return [max(0.0, a - overhead) for a in alone]


def _indices(system: list[int], latest: list[int], earlier: list[list[int]], kept) -> tuple[int, ...]:
    return tuple(sorted([*system, *latest, *(i for k in kept for i in earlier[k])]))


def _exchanges(messages: Sequence[ChatMessage]) -> list[list[int]]:
    """Non-system message indices grouped into exchanges: each user message starts one."""
    units: list[list[int]] = []
    for i, message in enumerate(messages):
        if message.role == "system":
            continue
        if message.role == "user" or not units:
            units.append([i])
        else:
            units[-1].append(i)
    return units


def _drop_order(
    messages: Sequence[ChatMessage],
    earlier: list[list[int]],
    latest: list[int],
    policy: ContextPolicy,
    recent_exchanges: int,
) -> list[int]:
    """Positions in `earlier`, in the order their exchanges are to be dropped."""
    if policy is ContextPolicy.DROP_OLDEST or not earlier:
        return list(range(len(earlier)))
    recent = list(range(max(0, len(earlier) - recent_exchanges), len(earlier)))
    older = range(len(earlier) - len(recent))
    users = [i for i in latest if messages[i].role == "user"]
    query = terms(" ".join(messages[i].content for i in (users or latest)))
    unit_terms = [terms(" ".join(messages[i].content for i in u)) for u in earlier]
    # Rarity within this conversation: a word in every turn ("price") tells turns apart less
    # than the product name that appears in one.
    df: dict[str, int] = {}
    for found in unit_terms:
        for term in found:
            df[term] = df.get(term, 0) + 1
    n = len(earlier)
    idf = {term: math.log(1 + n / count) for term, count in df.items()}
    scores = [overlap(query, found, idf) for found in unit_terms]
    unrelated = [k for k in older if scores[k] <= 0]
    # Least related first; among equals, oldest first.
    related = sorted((k for k in older if scores[k] > 0), key=lambda k: (scores[k], k))
    return unrelated + related + recent


def fit_request(
    request, tokenizer, *, policy: ContextPolicy = ContextPolicy.ENTITY_AWARE, max_turns: int | None = None
):
    """Applies the policy to a router InferenceRequest with its model's ModelTokenizer.

    Returns (request with the kept messages, ContextFit). A raw prompt is never cut: it
    either fits or fails with InvalidArgument giving the counts.
    """
    max_tokens = request.sampling.max_tokens
    if request.prompt is not None:
        ids = tokenizer.encode(request)
        tokenizer.check_fits(len(ids), max_tokens)
        return request, ContextFit((), tuple(ids), policy, (), (), len(ids))

    def encode(messages: Sequence[ChatMessage]) -> list[int]:
        return tokenizer.encode(replace(request, messages=tuple(messages)))

    fit = fit_conversation(
        request.messages,
        encode,
        max_context=tokenizer.max_context,
        max_tokens=max_tokens,
        policy=policy,
        max_turns=max_turns,
    )
    return (replace(request, messages=fit.messages) if fit.truncated else request), fit


async def fit_request_async(
    request, tokenizer, *, policy: ContextPolicy = ContextPolicy.ENTITY_AWARE, max_turns: int | None = None
):
    """`fit_request`, on a thread when the request is big enough to hold the event loop
    (a small one is fitted in place: the hop costs more than the work)."""
    chars = len(request.prompt) if request.prompt is not None else sum(len(m.content) for m in request.messages)
    if chars > OFF_LOOP_CHARS or len(request.messages) > OFF_LOOP_MESSAGES:
        return await asyncio.to_thread(fit_request, request, tokenizer, policy=policy, max_turns=max_turns)
    return fit_request(request, tokenizer, policy=policy, max_turns=max_turns)
