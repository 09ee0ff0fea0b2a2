"""Request scheduling in front of each model pool: tiers S/A/B, admission, preemption, auto-tagging.

`PoolScheduler` (pure, synchronous) decides which queued request goes to which worker;
`AsyncGate` lets router coroutines wait for that decision; `TierClassifier` turns rule
documents into a tier and weight for requests that did not name one.
"""
