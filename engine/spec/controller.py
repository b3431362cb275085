"""How many drafts pay off. Two signals, both measured:

- per sequence, its recent acceptance rate a (an exponential average of accepted / drafted): with a
  geometric model of acceptance, k drafts are expected to add a + a^2 + ... + a^k tokens to the one a
  step always makes;
- per step, its cost as a function of the tokens it computes, t(n) = fixed + per_token * n (a running
  least-squares fit of the worker's own steps): small batches are bound by reading the weights (the
  extra tokens are nearly free), large ones by compute (they cost their share).

Each step the controller picks the draft budget k (the same cap for every sequence, 0 = off) that
maximizes expected tokens per second, (B + sum of expected extras) / t(B + sum of k_i), so speculation
fades out by itself as the batch grows.
"""

from __future__ import annotations

from dataclasses import dataclass

CANDIDATE_KS = (0, 1, 2, 3, 4, 6, 8)


@dataclass(slots=True)
class _Fit:
    """Least squares of duration on tokens, exponentially weighted (recent steps count more)."""

    decay: float = 0.98
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = self.sw * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_token), or None until the steps seen differ enough in size to tell them apart."""
        if self.sw < 4:
            return None
        var = self.sxx / self.sw - (self.sx / self.sw) ** 2
        if var < 1.0:
            return None
        slope = max(0.0, (self.sxy / self.sw - self.sx * self.sy / self.sw ** 2) / var)
        fixed = max(0.0, self.sy / self.sw - slope * self.sx / self.sw)
        return fixed, slope


class SpecController:
    """`max_drafts`: the most drafts per sequence and step. `adaptive=False`: always `max_drafts`.
    `prior_accept`: a new sequence's acceptance rate before it has drafted anything."""

    def __init__(self, max_drafts: int = 4, adaptive: bool = True, prior_accept: float = 0.5, ema: float = 0.3):
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        self.max_drafts, self.adaptive, self.prior_accept, self.ema = max_drafts, adaptive, prior_accept, ema
        self._accept: dict[str, float] = {}
        self._fit = _Fit()
        # Counters for metrics: drafted, accepted, emitted tokens.
        self.num_drafted = self.num_accepted = self.num_emitted = 0

    def acceptance(self, seq_id: str) -> float:
        return self._accept.get(seq_id, self.prior_accept)

    @staticmethod
    def expected_extra(a: float, k: int) -> float:
        """Expected accepted drafts out of k with per-draft acceptance a (geometric model)."""
        return sum(a ** j for j in range(1, k + 1))

    def budget(self, seq_ids: list[str]) -> int:
        """The draft cap for this step's sequences (0: do not speculate this step)."""
        if not seq_ids:
            return 0
        if not self.adaptive:
            return self.max_drafts
        line = self._fit.line()
        rates = [self.acceptance(s) for s in seq_ids]
        b = len(seq_ids)
        if line is None:  # no cost model yet: explore with a small budget so the fit sees bigger steps
            return min(2, self.max_drafts)
        fixed, per_token = line
        best_k, best = 0, b / max(fixed + per_token * b, 1e-9)
        for k in CANDIDATE_KS[1:]:
            if k > self.max_drafts:
                break
            tokens = b + sum(self.expected_extra(a, k) for a in rates)
            rate = tokens / max(fixed + per_token * (b + b * k), 1e-9)
            if rate > best * 1.02:  # a clear gain only: noise must not flip it on
                best_k, best = k, rate
        return best_k

    def draft_len(self, seq_id: str, budget: int) -> int:
        """Drafts for one sequence within the step's budget: fewer when it accepts little."""
        if budget <= 0:
            return 0
        a = self.acceptance(seq_id)
        # Stop where one more draft is expected to add less than a tenth of a token.
        k = 0
        while k < budget and a ** (k + 1) >= 0.1:
            k += 1
        return max(1, k)

    def record_step(self, num_tokens: int, duration_s: float) -> None:
        self._fit.add(float(num_tokens), duration_s)

    def record_verify(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        """After verification: `num_accepted` of `num_drafted` drafts held (1 + that many emitted)."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
        if num_drafted:
            a = self.acceptance(seq_id)
            self._accept[seq_id] = (1 - self.ema) * a + self.ema * (num_accepted / num_drafted)

    def finish(self, seq_id: str) -> None:
        self._accept.pop(seq_id, None)
