"""Router resilience: the pure decisions that keep a user's stream flowing when workers fail.

- `breaker`: per-worker circuit breakers fed by classified call outcomes.
- `retry_budget`: caps retries and resumes so a failing pool cannot become a retry storm.
- `temperature`: keeps hot GPUs out of rotation, with hysteresis.
- `stall`: per-tier "no token for X seconds" timeouts and an async iterator guard.
- `resume`: the continuation of a broken stream on another worker.
- `health_view`: combines the above with membership into one routability predicate.

Everything here is network-free and takes an injectable clock, so it is tested with
simulated time.
"""
