"""How many drafts pay off. Two signals, both measured:

- per sequence, its recent acceptance rate a (an exponential average of accepted / drafted): with a
  geometric model of acceptance, k drafts are expected to add a + a^2 + ... + a^k tokens to the one a
  step always makes;
- per step, its cost as a function of the tokens it computes, t(n) = fixed + per_token * n (a robust
  fit of the worker's own recent decode steps, `_StepCosts`): small batches are bound by reading the
  weights (the extra tokens are nearly free), large ones by compute (they cost their share).

Each step the controller picks the draft budget k (the same cap for every sequence, 0 = off) that
maximizes expected tokens per second, (B + sum of expected extras) / t(B + sum of k_i), so speculation
fades out by itself as the batch grows.
"""

from __future__ import annotations

from collections import defaultdict, deque
from statistics import median

CANDIDATE_KS = (0, 1, 2, 3, 4, 6, 8)
GAIN_MARGIN = 1.08  # a budget must promise this many times the tokens per second of the next smaller one
# Per step without a verification, a sequence's acceptance estimate keeps this share of its distance
# from the engine's average (0.9: half of it is gone after ~7 steps).
FORGET = 0.9
# After this many steps in a row without drafts, one step lets a few sequences draft one token
# (`exploring`), so the acceptance estimates and the cost model see fresh evidence.
PROBE_EVERY = 32


class _StepCosts:
    """Step duration against tokens computed, over the worker's last `window` decode steps, fitted
    robustly: the median duration at each token count (in at most `max_groups` groups of nearby
    counts), then the median of the slopes between groups (Theil-Sen) and the median intercept.

    NOTE: not least squares. Measured on 2 CPU cores, a few steps take 5-30x their usual time (the
    first step after a burst of prompts, a neighbour process, the allocator) and a least-squares fit
    of them flipped the decision for whole runs; medians ignore them. The window is long because the
    line belongs to the model and the device, not to the traffic: it moves only with context length."""

    def __init__(self, window: int = 256, refit_every: int = 8, max_groups: int = 32, min_points: int = 8):
        self.refit_every, self.max_groups, self.min_points = refit_every, max_groups, min_points
        self._points: deque[tuple[float, float]] = deque(maxlen=window)
        self._line: tuple[float, float] | None = None
        self._new = 0  # points added since the last fit

    def add(self, x: float, y: float) -> None:
        self._points.append((x, y))
        self._new += 1

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_token), or None until the steps seen differ in size (then: explore)."""
        if self._new >= self.refit_every or (self._line is None and self._new):
            self._line, self._new = self._fit(), 0
        return self._line

    def _fit(self) -> tuple[float, float] | None:
        by_x: dict[float, list[float]] = defaultdict(list)
        for x, y in self._points:
            by_x[x].append(y)
        if len(self._points) < self.min_points or len(by_x) < 2:
            return None
        xs = sorted(by_x)
        per = -(-len(xs) // self.max_groups)  # neighbouring counts share a group when there are many
        groups = [xs[g:g + per] for g in range(0, len(xs), per)]
        gx = [median(g) for g in groups]
        gy = [median([y for x in g for y in by_x[x]]) for g in groups]
        if len(gx) < 2:
            return None
        slopes = [(gy[b] - gy[a]) / (gx[b] - gx[a]) for a in range(len(gx)) for b in range(a + 1, len(gx))]
        slope = max(0.0, median(slopes))
        fixed = max(0.0, median([y - slope * x for x, y in zip(gx, gy)]))
        return fixed, slope


class SpecController:
    """`max_drafts`: the most drafts per sequence and step. `adaptive=False`: always `max_drafts`.
    `prior_accept`: a sequence's acceptance rate before it has drafted anything, until this engine's
    own verifications say better (a slow average over all of them takes its place).

    NOTE: a sequence's estimate ages back to the engine's average while it does not draft. Without
    that, a few rejected guesses (a sequence's opening words, before it starts copying) pushed its
    estimate so low that no budget paid; it never drafted again, so nothing could raise it: measured
    on a copying prompt at batch 1, 24 drafting steps of 178 and 18 tok/s where 28 were possible."""

    def __init__(self, max_drafts: int = 4, adaptive: bool = True, prior_accept: float = 0.5, ema: float = 0.3):
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        self.max_drafts, self.adaptive, self.prior_accept, self.ema = max_drafts, adaptive, prior_accept, ema
        self._accept: dict[str, tuple[float, int]] = {}  # seq -> (acceptance estimate, step it was measured)
        self._step = 0  # budget() calls: the controller's clock
        # NOTE: a sequence without history starts from what this engine's drafts achieve (measured on
        # SmolLM2: ~0.3 for free text, ~0.8 for copying), not from a fixed guess that overstates the
        # gain on one workload and understates it on the other.
        self._engine_accept = prior_accept
        self._costs = _StepCosts()
        self.exploring = False  # the last budget() explores (no cost model yet, or a probe): few sequences draft
        self._idle_steps = 0  # budget() calls in a row that chose 0
        # Counters for metrics: drafted, accepted, emitted tokens.
        self.num_drafted = self.num_accepted = self.num_emitted = 0

    def acceptance(self, seq_id: str) -> float:
        got = self._accept.get(seq_id)
        if got is None:
            return self._engine_accept
        a, at = got
        idle = self._step - at - 1  # steps since the one that measured it (drafting every step: 0)
        return self._engine_accept + (a - self._engine_accept) * FORGET ** max(0, idle)

    @staticmethod
    def expected_extra(a: float, k: int) -> float:
        """Expected accepted drafts out of k with per-draft acceptance a (geometric model)."""
        return sum(a ** j for j in range(1, k + 1))

    def budget(self, seq_ids: list[str], explore: bool = True) -> int:
        """The draft cap for this step's sequences (0: do not speculate this step). `explore=False`:
        the step will not teach the cost model (it computes prompt tokens too), so without a model it
        drafts nothing rather than guess."""
        if not seq_ids:
            return 0
        self._step += 1
        if not self.adaptive:
            return self.max_drafts
        line = self._costs.line()
        self.exploring = line is None and explore
        if line is None:  # no cost model yet: explore with a small budget so the fit sees bigger steps
            return min(2, self.max_drafts) if explore else 0
        k = self._best_k([self.acceptance(s) for s in seq_ids], line)
        # NOTE: a probe. Estimates only move when drafts are verified, so once they said "no" they
        # could never say "yes" again: on random prompts at batch 64 one bad stretch of guesses (the
        # engine's average fell from 0.9 to 0.62) turned drafting off for the remaining 60 steps
        # although 89% of suffix decoding's drafts had held.
        self._idle_steps = self._idle_steps + 1 if k == 0 else 0
        if self._idle_steps >= PROBE_EVERY and explore:
            self._idle_steps, self.exploring = 0, True
            return 1
        return k

    def _best_k(self, rates: list[float], line: tuple[float, float]) -> int:
        """The budget that maximizes expected tokens per second for sequences with these acceptance
        rates, under the step-cost line (fixed, per_token)."""
        b = len(rates)
        fixed, per_token = line
        best_k, best = 0, b / max(fixed + per_token * b, 1e-9)
        for k in CANDIDATE_KS[1:]:
            if k > self.max_drafts:
                break
            tokens = b + sum(self.expected_extra(a, k) for a in rates)
            rate = tokens / max(fixed + per_token * (b + b * k), 1e-9)
            # NOTE: a clear gain only. The fit is noisy (a few ms per step on a shared CPU), and near
            # break-even a noisy fit flipped speculation on where it lost 5% (free text, batch 64);
            # what the margin gives up is a few percent where the model says it pays.
            if rate > best * GAIN_MARGIN:
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
        self._costs.add(float(num_tokens), duration_s)

    def record_verify(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        """After verification: `num_accepted` of `num_drafted` drafts held (1 + that many emitted)."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
        if num_drafted:
            a = self.acceptance(seq_id)
            self._accept[seq_id] = ((1 - self.ema) * a + self.ema * (num_accepted / num_drafted), self._step)
            self._engine_accept = 0.98 * self._engine_accept + 0.02 * (num_accepted / num_drafted)

    def finish(self, seq_id: str) -> None:
        self._accept.pop(seq_id, None)
