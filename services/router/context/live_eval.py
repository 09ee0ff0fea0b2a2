"""Publishes `context_retention_rate` for each policy, measured with a real model tokenizer.

Runs the evaluation set (generated long conversations in English and Chinese, each with one
fact the last question needs) once per model version the router learns of, in a thread, so
the gauge reflects the tokenizer actually in use.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from services.common.generation import Sampling
from services.common.tier import Tier
from services.router.context.evaluation import retention_rate, synthetic_cases
from services.router.context.metrics import ContextMetrics
from services.router.context.window import ContextPolicy
from services.router.requests import InferenceRequest, Message
from services.router.tokenization import ModelTokenizer

log = logging.getLogger(__name__)
EVALUATION_CASES = 12


def _evaluate(tokenizer: ModelTokenizer, metrics: ContextMetrics) -> None:
    template = InferenceRequest(
        request_id="retention-eval",
        session_id="",
        tenant="",
        model="",
        sampling=Sampling(max_tokens=64),
        tier=Tier.A,
        messages=(Message("user", "x"),),
    )

    def encode(messages) -> list[int]:
        turns = tuple(Message(m.role, m.content) for m in messages)
        return tokenizer.encode(replace(template, messages=turns))

    cases = synthetic_cases(EVALUATION_CASES, seed=7)
    for policy in (ContextPolicy.ENTITY_AWARE, ContextPolicy.DROP_OLDEST):
        result = retention_rate(cases, encode, policy)
        metrics.set_retention_rate(policy.value, result.rate)
        log.info("context retention on %s: %s %.3f", tokenizer.model_version, policy.value, result.rate)


async def publish_retention(tokenizer: ModelTokenizer, metrics: ContextMetrics) -> None:
    try:
        await asyncio.to_thread(_evaluate, tokenizer, metrics)
    except Exception:  # a metric must never take the router down
        log.exception("context retention evaluation failed")
