"""The engine's side of a KV transfer: blocks lent out for export and blocks taken in on import.

`KVLending(engine)` wraps one `LLMEngine`; it holds no state of its own, so any holder of the engine
may make one. A prefill-only request keeps its blocks after its prompt is computed
(`prefilled_block_ids`) until `release_prefilled`; an importer allocates blocks (`allocate_blocks`),
fills them, and hands them to the engine with `add_prefilled_request`, or registers them in the prefix
cache (`cache_blocks`). Exports of blocks that outlive their request take a reference
(`pin_computed_blocks`, `take_cached_blocks`) that `free_blocks` drops.

NOTE: the engine's owner calls these under the same lock as `LLMEngine.step` (block-manager-only
calls may run during a step's forward pass: deployments/engine_host.py, `EngineHost.on_blocks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING


from engine.llm_engine import _resumed_tail
from engine.sampling_params import check_cache_salt, check_tenant
from engine.request import Request, RequestStatus, extend_block_keys
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class KVLending:
    """Lends the blocks of one engine for KV transfer, and takes imported ones in."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def release_prefilled(self, request_id: str) -> bool:
        """Free the KV blocks a prefill-only request kept for export."""
        self.engine._requests.pop(request_id, None)
        return self.engine.scheduler.release_prefilled(request_id)

    def prefilled_block_ids(self, request_id: str) -> list[int]:
        return list(self.engine.scheduler.prefilled[request_id].block_table)

    def allocate_blocks(self, num_tokens: int, contiguous: bool = False) -> list[int] | None:
        """Blocks to receive `num_tokens` tokens of imported KV, or None if they are not free.
        `contiguous`: one run of consecutive ids if the pool has one (else any free blocks)."""
        n = self.engine.block_manager.blocks_for_tokens(num_tokens)
        if not self.engine.block_manager.can_allocate(n):
            return None
        if contiguous:
            run = self.engine.block_manager.allocate_contiguous(n)
            if run is not None:
                return run
        return self.engine.block_manager.allocate(n)

    def free_blocks(self, block_ids: list[int]) -> None:
        self.engine.block_manager.free(block_ids)

    def pin_computed_blocks(self, request_id: str, max_tokens: int, first_block: int = 0) -> list[int]:
        """A reference on each full block of `request_id`'s first `max_tokens` tokens whose KV is
        computed, from block `first_block` on, so it survives the request (to export a copy);
        `free_blocks` drops it. [] if there is none or the request is not running here."""
        req = self.engine._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return []
        n = min(max_tokens, req.num_computed_tokens) // self.engine.block_manager.block_size
        block_ids = list(req.block_table[first_block:n])
        self.engine.block_manager.incref(block_ids)
        return block_ids

    def take_cached_blocks(self, token_ids: list[int], max_tokens: int | None = None,
                           cache_salt: str | None = None) -> list[int]:
        """A reference on each cached block of the longest cached prefix of `token_ids` (full blocks,
        at most `max_tokens` tokens), so it can be exported (a decode worker fetching a prefix this
        engine holds); `free_blocks` drops it. [] when nothing is cached."""
        if not self.engine.config.enable_prefix_caching:
            return []
        bs = self.engine.block_manager.block_size
        n = len(token_ids[:max_tokens]) // bs
        block_ids = self.engine.block_manager.lookup(extend_block_keys([], token_ids, n, bs, cache_salt)) if n else []
        self.engine.block_manager.take(block_ids)
        return block_ids

    def cache_blocks(self, token_ids: list[int], block_ids: list[int], first_block: int = 0,
                     cache_salt: str | None = None) -> int:
        """Imported KV into the prefix cache: `block_ids` (from `allocate_blocks`) hold the full blocks
        `first_block`, `first_block` + 1, ... of `token_ids`. Each is registered under its key (unless
        that key is cached already), then freed: cached and free, like a finished request's blocks.
        Returns how many were registered."""
        bs = self.engine.block_manager.block_size
        keys = extend_block_keys([], token_ids, first_block + len(block_ids), bs, cache_salt)[first_block:]
        assert len(keys) == len(block_ids), f"{len(block_ids)} blocks but {len(keys)} full blocks of tokens"
        before = self.engine.block_manager.num_cached_blocks
        if self.engine.config.enable_prefix_caching:
            for b, key in zip(block_ids, keys):
                self.engine.block_manager.register(b, key)
        self.engine.block_manager.free(block_ids)
        return self.engine.block_manager.num_cached_blocks - before

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                              params: SamplingParams, block_ids: list[int], num_computed_tokens: int,
                              priority: int = 0, cache_salt: str | None = None, num_resumed_output: int = 0,
                              tenant: str | None = None, tenant_weight: float = 1.0) -> None:
        """Resume decoding a request whose first `num_computed_tokens` tokens of KV are already in
        `block_ids` (allocated with `allocate_blocks`). The engine owns the blocks from now on. A grammar
        continues after `output_token_ids`; prompt logprobs are not computed again (they came with it)."""
        check_cache_salt(cache_salt)
        check_tenant(tenant, tenant_weight)
        resumed = _resumed_tail(prompt_token_ids, num_resumed_output)
        req = Request(request_id, list(prompt_token_ids), params, priority=priority,
                      sample_seed=self.engine._new_sample_seed(params), cache_salt=cache_salt, prompt_logprobs_sent=True,
                      num_resumed_output=len(resumed), tenant=tenant, tenant_weight=float(tenant_weight))
        req.output_token_ids = list(output_token_ids)
        req.block_table = list(block_ids)
        req.num_computed_tokens = num_computed_tokens
        assert num_computed_tokens < req.num_tokens, "nothing left to decode"
        # A grammar not compiled here yet: the request (and its blocks) waits off the step loop for it.
        self.engine.admit_with_grammar(req, resumed + list(output_token_ids), self.engine.scheduler.add_running)
