"""The engine's side of speculative decoding: before each step, drafts for the decoding requests; after
it, what verification kept, for the controller and the counters.

    LLMEngine.step:  propose (drafts on each Request) -> schedule (drafts fill what is left) -> run
                     (logits at every drafted position) -> sample/verify -> append, commit, record
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.request import Request
from engine.spec.controller import SpecController
from engine.spec.proposer import make_proposer

# Sequences that draft in a step taken only to teach the cost model or refresh the acceptance estimates
# (`SpecController.exploring`):
# enough to make the step measurably bigger, few enough that a large batch barely notices.
EXPLORE_SEQS = 8


@dataclass(slots=True)
class SpecStats:
    """Speculation counters of one engine since it started (for the serving layer's metrics)."""

    method: str  # the engine's speculative_method ("off": all counters stay 0)
    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, accepted
    num_emitted: int = 0  # tokens verification produced: accepted drafts + one of the model's own per row
    num_verified_rows: int = 0  # sequence-steps that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying sequence-step (accepted drafts + 1): 1.0 means no draft ever held."""
        return self.num_emitted / self.num_verified_rows if self.num_verified_rows else 0.0


class Speculator:
    """One proposer and one controller for an engine whose `speculative_method` is not "off"."""

    def __init__(self, config: EngineConfig):
        options = {"max_drafts": config.num_speculative_tokens} if config.speculative_method == "suffix" else {}
        proposer = make_proposer(config.speculative_method, **options)
        assert proposer is not None, "no Speculator for speculative_method='off'"
        self.proposer = proposer
        self.controller = SpecController(config.num_speculative_tokens, config.speculative_adaptive)
        self.stats = SpecStats(config.speculative_method)
        self._explore_from = 0  # exploring steps take turns over the running sequences

    def propose(self, running: list[Request], max_model_len: int, prompts_waiting: bool = False) -> None:
        """Set `spec_token_ids` of every running request for the next step ([] where it gets none).

        A request drafts when it is decoding (one token to compute), is not prefill-only and did not
        opt out; never more drafts than could be emitted before max_tokens or the context limit.
        `prompts_waiting`: requests wait with room to be admitted (the step will likely compute prompt
        tokens)."""
        eligible = []
        prefilling = prompts_waiting
        for req in running:
            req.spec_token_ids = []
            if req.num_tokens - req.num_computed_tokens > 1:
                prefilling = True
            elif not req.prefill_only and req.params.can_speculate:  # logprobs, grammars, penalties: never
                eligible.append(req)
        # A step with prompt tokens does not teach the cost model (`LLMEngine.step` records decode-only
        # steps), so it does not explore: behind a burst of prompts, exploring drafts were pure cost.
        budget = self.controller.budget([r.request_id for r in eligible], explore=not prefilling)
        if budget <= 0:
            return
        if self.controller.exploring and len(eligible) > EXPLORE_SEQS:  # a few sequences' drafts suffice
            start = self._explore_from % len(eligible)
            self._explore_from = start + EXPLORE_SEQS
            eligible = (eligible[start:] + eligible[:start])[:EXPLORE_SEQS]
        for req in eligible:
            # k drafts emit up to k + 1 tokens.
            room = min(req.params.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens) - 1
            k = min(self.controller.draft_len(req.request_id, budget), room)
            if k > 0:
                req.spec_token_ids = self.proposer.propose(req.request_id, req.all_token_ids, k,
                                                           **_scope(req))[:k]

    def record_verify(self, req: Request, num_drafted: int, num_emitted: int) -> None:
        """Verification of `num_drafted` drafts of `req` produced `num_emitted` tokens."""
        self.controller.record_verify(req.request_id, num_drafted, num_emitted - 1)
        s = self.stats
        s.num_drafted += num_drafted
        s.num_accepted += num_emitted - 1
        s.num_emitted += num_emitted
        s.num_verified_rows += 1

    def record_step(self, num_batched_tokens: int, duration_s: float) -> None:
        self.controller.record_step(num_batched_tokens, duration_s)

    def finish(self, req: Request) -> None:
        """`req` ended (finished, failed or aborted): drop its state (its output may teach the proposer)."""
        req.spec_token_ids = []
        self.controller.finish(req.request_id)
        if not req.prefill_only:
            self.proposer.finish(req.request_id, list(req.output_token_ids), **_scope(req))


def _scope(req: Request) -> dict:
    """The proposer's `scope` for `req` (its cache salt), passed only when it has one, so a proposer written
    without scopes keeps working for unsalted requests."""
    return {} if req.cache_salt is None else {"scope": req.cache_salt}
