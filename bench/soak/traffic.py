"""The soak's traffic: seeded multi-turn agent sessions, planned before either phase runs.

Both phases of `bench.soak` replay the same plan, so they see the same sessions at the same
offsets with the same turns. Sessions arrive open loop (Poisson, by thinning, so the rate can
change over time): the base rate, three times it during the surge window. Inside a session
the turns are sequential, as an agent's are: the next turn is sent a think time after the
previous answer ended, with the conversation so far (the last `CONTEXT_TURNS` exchanges, so
the prompt grows and then stays within the model's context on both sides alike).

Each turn has a tier (S payment confirmations, A account questions, B summaries, drawn
10/30/60 %) and one turn in five asks for JSON that must satisfy a schema. Nothing here
touches the network: the plan is data, unit-tested on its own.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

TIER_MIX = (("S", 0.10), ("A", 0.30), ("B", 0.60))
ONLY_S = (("S", 1.0),)
JSON_SHARE = 0.20
TURNS = (6, 12)
THINK_S = (0.3, 1.5)
# Exchanges of earlier turns a request carries: the context grows over a session's first
# turns, then slides.
CONTEXT_TURNS = 3
# Answer lengths by tier: a payment confirmation is short, a summary long.
MAX_TOKENS = {"S": 12, "A": 32, "B": 64}
JSON_MAX_TOKENS = 48

SCHEMAS = {
    "payment_confirmation": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "status": {"enum": ["paid", "declined", "pending"]},
            "amount": {"type": "number"},
        },
        "required": ["order_id", "status", "amount"],
        "additionalProperties": False,
    },
    "ticket_triage": {
        "type": "object",
        "properties": {
            "category": {"enum": ["billing", "shipping", "account", "other"]},
            "urgent": {"type": "boolean"},
        },
        "required": ["category", "urgent"],
        "additionalProperties": False,
    },
    "order_summary": {
        "type": "object",
        "properties": {"order_id": {"type": "string"}, "items": {"type": "integer"}},
        "required": ["order_id", "items"],
        "additionalProperties": False,
    },
}

_TASKS = {
    "S": (
        "Confirm the payment for order {order} of {amount} euros.",
        "Was card payment {order} for {amount} euros accepted?",
    ),
    "A": (
        "The customer on account {account} asks why order {order} has not shipped.",
        "Account {account} wants to change the delivery address of order {order}.",
    ),
    "B": (
        "Summarise the conversation so far about order {order} and list the open questions.",
        "Write a short summary of account {account}'s last three orders, including {order}.",
    ),
}


@dataclass(frozen=True)
class TurnPlan:
    index: int
    tier: str
    text: str
    max_tokens: int
    # A JSON Schema the answer must satisfy, or None for free text.
    schema_name: str | None
    seed: int
    # Pause after the previous turn's answer before this one is sent (0 for the first).
    think_s: float

    @property
    def schema(self) -> dict | None:
        return SCHEMAS[self.schema_name] if self.schema_name else None

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema) if self.schema_name else ""


@dataclass(frozen=True)
class SessionPlan:
    id: str
    start_s: float
    turns: tuple[TurnPlan, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Surge:
    """The arrival rate is `factor` times the base rate from `start_s` to `end_s`."""

    start_s: float
    end_s: float
    factor: float = 3.0

    def rate_factor(self, t: float) -> float:
        return self.factor if self.start_s <= t < self.end_s else 1.0


NO_SURGE = Surge(0.0, 0.0, 1.0)


def arrivals(rng: random.Random, duration_s: float, base_rate: float, surge: Surge) -> list[float]:
    """Poisson arrival times over [0, duration_s) whose rate is base_rate x surge factor,
    drawn by thinning a process at the peak rate."""
    if base_rate <= 0:
        return []
    peak = base_rate * max(1.0, surge.factor)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return times
        if rng.random() < surge.rate_factor(t) * base_rate / peak:
            times.append(t)


def _tier(rng: random.Random, mix: tuple[tuple[str, float], ...]) -> str:
    draw, total = rng.random(), 0.0
    for tier, share in mix:
        total += share
        if draw < total:
            return tier
    return mix[-1][0]


def _turn(rng: random.Random, index: int, account: int, mix: tuple[tuple[str, float], ...]) -> TurnPlan:
    tier = _tier(rng, mix)
    schema_name = rng.choice(sorted(SCHEMAS)) if rng.random() < JSON_SHARE else None
    text = rng.choice(_TASKS[tier]).format(order=rng.randint(1000, 9999), amount=rng.randint(5, 900), account=account)
    if schema_name:
        text += f" Answer as JSON ({schema_name.replace('_', ' ')})."
    return TurnPlan(
        index=index,
        tier=tier,
        text=text,
        max_tokens=JSON_MAX_TOKENS if schema_name else MAX_TOKENS[tier],
        schema_name=schema_name,
        seed=rng.randrange(1, 2**31),
        think_s=0.0 if index == 0 else round(rng.uniform(*THINK_S), 3),
    )


def plan_sessions(
    seed: int, duration_s: float, base_rate: float, surge: Surge, mix: tuple[tuple[str, float], ...] = TIER_MIX
) -> list[SessionPlan]:
    """The sessions of one soak, the same for every call with the same arguments. `mix`:
    each turn's tier and its share (the unloaded S measurement asks for S turns only)."""
    rng = random.Random(seed)
    sessions = []
    for number, start in enumerate(arrivals(rng, duration_s, base_rate, surge)):
        account = rng.randint(10_000, 99_999)
        turns = tuple(_turn(rng, i, account, mix) for i in range(rng.randint(*TURNS)))
        sessions.append(SessionPlan(id=f"soak-{seed}-{number:05d}", start_s=round(start, 4), turns=turns))
    return sessions


@dataclass
class Conversation:
    """What a session has said so far; both phases build each turn's messages the same way."""

    history: list[dict] = field(default_factory=list)

    def messages_for(self, turn: TurnPlan) -> list[dict]:
        recent = self.history[-2 * CONTEXT_TURNS :]
        return [*recent, {"role": "user", "content": turn.text}]

    def record(self, turn: TurnPlan, answer: str) -> None:
        self.history += [{"role": "user", "content": turn.text}, {"role": "assistant", "content": answer}]
