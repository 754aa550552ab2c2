"""What an engine step costs, learned from the steps it runs (engine.py's)."""
from __future__ import annotations


class StepCost:
    """What a step costs, fixed and per token fed, for sizing speculative
    drafts (Scheduler.set_step_cost): the per-token cost is the slope of
    the forward pass's seconds over the tokens fed (least squares, older
    steps weighing less), the fixed cost what the whole step took beyond
    that (a moving average). Steps of up to ``MAX_TOKENS`` only: decodes
    and drafts, not long prefills."""

    MAX_TOKENS = 64

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.sums = [0.0] * 5   # weight, x, y, xx, xy
        self.fixed: float | None = None

    def add(self, tokens: int, forward: float, step: float) -> tuple[float, float] | None:
        """Record a step's seconds; the fit (fixed, per token) once it has one."""
        if tokens > self.MAX_TOKENS:
            return None
        point = (1.0, tokens, forward, tokens * tokens, tokens * forward)
        self.sums = [s * self.decay + v for s, v in zip(self.sums, point)]
        n, x, y, xx, xy = self.sums
        spread = xx * n - x * x
        if n < 4 or spread <= 1e-6 * n * n:
            return None
        per_token = max(0.0, (xy * n - x * y) / spread)
        rest = max(0.0, step - per_token * tokens)
        self.fixed = rest if self.fixed is None else self.fixed + 0.1 * (rest - self.fixed)
        return self.fixed, per_token
