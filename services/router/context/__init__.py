"""Context in the router: count a conversation's tokens with the model's tokenizer and chat
template, fit it into the model's context with a per-request policy, and measure retention."""

from services.router.context.evaluation import Retention, RetentionCase, retention_rate, synthetic_cases
from services.router.context.metrics import ContextMetrics
from services.router.context.window import ContextFit, ContextPolicy, fit_conversation, fit_request

__all__ = [
    "ContextFit",
    "ContextMetrics",
    "ContextPolicy",
    "Retention",
    "RetentionCase",
    "fit_conversation",
    "fit_request",
    "retention_rate",
    "synthetic_cases",
]
