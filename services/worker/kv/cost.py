"""Running estimates of what a KV prefix costs to recompute and to restore, and the choice.

Both costs are fitted online, by recursive least squares with forgetting, from what this
worker measures as it serves:

  prefill of n tokens after `start` cached ones:  c0 + a*n + b*n*(start + n/2)
      (per forward call; the last term is attention over the tokens already there)
  restore of k tokens from the cache service:      r0 + r1*k

Restoring k tokens saves exactly the prefill of tokens [0, k); it is chosen when its
estimate is lower. Until restore has been measured a few times it is tried (an optimistic
prior), and now and then again after it lost, so the estimate follows the machine.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

# Features are in thousands of tokens, so both fits stay well conditioned.
_K = 1000.0


class OnlineFit:
    """y ~ theta . x, refitted at each sample; old samples fade by `forgetting` per sample."""

    def __init__(self, dims: int, forgetting: float = 0.97, prior: float = 1e4) -> None:
        self.dims = dims
        self.forgetting = forgetting
        self._prior = prior
        self.theta = [0.0] * dims
        self._p = [[prior if i == j else 0.0 for j in range(dims)] for i in range(dims)]
        self.samples = 0

    def observe(self, x: list[float], y: float) -> None:
        if not math.isfinite(y):
            return
        n, lam, p = self.dims, self.forgetting, self._p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        error = y - sum(t * v for t, v in zip(self.theta, x))
        self.theta = [t + g * error for t, g in zip(self.theta, gain)]
        # P <- (P - gain x^T P) / lambda, kept symmetric.
        xp = px  # x^T P equals (P x)^T because P is symmetric
        self._p = [[(p[i][j] - gain[i] * xp[j]) / lam for j in range(n)] for i in range(n)]
        # Without excitation in some direction P grows without bound there; cap it.
        trace = sum(self._p[i][i] for i in range(n))
        if trace > self._prior * n:
            scale = self._prior * n / trace
            self._p = [[v * scale for v in row] for row in self._p]
        self.samples += 1

    def predict(self, x: list[float]) -> float:
        # Every term is a cost, so a coefficient the noise drove negative counts as zero.
        return sum(max(0.0, t) * v for t, v in zip(self.theta, x))


@dataclass(frozen=True)
class Decision:
    restore: bool
    reason: str
    restore_ms: float
    recompute_ms: float


class CostModel:
    """Thread-safe: the engine thread reports prefill times, the event loop decides."""

    def __init__(
        self, prefill_chunk: int = 512, min_restore_samples: int = 2, explore_every: int = 64, forgetting: float = 0.97
    ) -> None:
        self.prefill_chunk = max(1, prefill_chunk)
        self.min_restore_samples = min_restore_samples
        self.explore_every = explore_every
        self._prefill = OnlineFit(3, forgetting)
        self._restore = OnlineFit(2, forgetting)
        self._lookup_ms: float | None = None
        self._lost_since_explore = 0
        self._lock = threading.Lock()

    # --- measurements -----------------------------------------------------------------
    def observe_prefill(self, start: int, tokens: int, ms: float) -> None:
        if tokens <= 0:
            return
        n, mid = tokens / _K, (start + tokens / 2) / _K
        with self._lock:
            self._prefill.observe([1.0, n, n * mid], ms)

    def observe_restore(self, tokens: int, ms: float) -> None:
        if tokens <= 0:
            return
        with self._lock:
            self._restore.observe([1.0, tokens / _K], ms)

    def observe_lookup(self, ms: float) -> None:
        with self._lock:
            self._lookup_ms = ms if self._lookup_ms is None else 0.8 * self._lookup_ms + 0.2 * ms

    # --- estimates --------------------------------------------------------------------
    @property
    def prefill_samples(self) -> int:
        return self._prefill.samples

    @property
    def restore_samples(self) -> int:
        return self._restore.samples

    def recompute_ms(self, tokens: int) -> float:
        """Estimated prefill time of tokens [0, tokens), in chunks as the engine runs it."""
        if tokens <= 0:
            return 0.0
        chunks = math.ceil(tokens / self.prefill_chunk)
        k = tokens / _K
        with self._lock:
            theta = [max(0.0, t) for t in self._prefill.theta]
        return chunks * theta[0] + theta[1] * k + theta[2] * k * k / 2

    def restore_ms(self, tokens: int) -> float:
        with self._lock:
            return self._restore.predict([1.0, tokens / _K])

    def lookup_ms(self) -> float | None:
        return self._lookup_ms

    # --- choices ----------------------------------------------------------------------
    def worth_lookup(self, tokens: int) -> bool:
        """False when restoring `tokens` would not save more than the lookup itself costs, so
        a short prefix goes straight to prefill without paying for the question."""
        if self._prefill.samples == 0 or self._lookup_ms is None:
            return True
        if self._restore.samples < self.min_restore_samples:
            return self.recompute_ms(tokens) > self._lookup_ms
        return self.recompute_ms(tokens) - self.restore_ms(tokens) > self._lookup_ms

    def decide(self, tokens: int) -> Decision:
        restore_ms, recompute_ms = self.restore_ms(tokens), self.recompute_ms(tokens)
        if self._restore.samples < self.min_restore_samples:
            return Decision(True, "learning", restore_ms, recompute_ms)
        if self._prefill.samples == 0:
            return Decision(True, "no-prefill-estimate", restore_ms, recompute_ms)
        if restore_ms < recompute_ms:
            self._lost_since_explore = 0
            return Decision(True, "cheaper", restore_ms, recompute_ms)
        self._lost_since_explore += 1
        if self.explore_every and self._lost_since_explore >= self.explore_every and restore_ms < 3 * recompute_ms:
            # Conditions change (a cache moved closer, the engine got busier): re-measure now
            # and then, but only where a wrong guess costs little.
            self._lost_since_explore = 0
            return Decision(True, "explore", restore_ms, recompute_ms)
        return Decision(False, "dearer", restore_ms, recompute_ms)
