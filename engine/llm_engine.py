"""The engine loop (`LLMEngine`: add_request / step / abort) and the offline API (`LLM.generate`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, kv_cache_torch_dtype
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.model_loader import load_model_and_tokenizer
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput, RequestStatus, extend_block_keys
from engine.sampler import SampleResult, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)
MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(cache_salt: str | None) -> None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS):
        raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")

Prompt = str | list[int]


@dataclass(slots=True)
class StepStats:
    """What the last step did; the serving layer reports it to the router."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    num_preempted: int = 0
    num_cached_tokens: int = 0  # prompt tokens requests admitted in this step took from the prefix cache
    duration_s: float = 0.0


class LLMEngine:
    """One model on one device with a paged KV cache and a token-budget scheduler.

    `step()` is `schedule -> run -> postprocess`; everything else manages requests.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = replace(config or EngineConfig(), **overrides) if overrides else (config or EngineConfig())
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.hf_model, self.tokenizer, self.model_dir = load_model_and_tokenizer(
            config.model, config.dtype, config.device, config.cache_dir)
        hf_cfg = self.hf_model.config
        kv_dtype = getattr(torch, kv_cache_torch_dtype(config.kv_cache_dtype, config.dtype))
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            block_bytes = ModelRunner.kv_block_bytes(hf_cfg, config.block_size, kv_dtype)
            num_blocks = max(1, config.kv_cache_memory_mb * 2**20 // block_bytes)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(self.hf_model, num_blocks, config.block_size, config.device, kv_dtype)
        limits = [hf_cfg.max_position_embeddings, num_blocks * config.block_size]
        if config.max_model_len:
            limits.append(config.max_model_len)
        window = getattr(hf_cfg, "sliding_window", None)
        if window and getattr(hf_cfg, "use_sliding_window", True):
            limits.append(window)  # no sliding-window attention yet: stay inside the window
        self.max_model_len = min(limits)
        eos = set()
        for src in (self.hf_model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(src, int):
                eos.add(src)
            elif src:
                eos.update(src)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = hf_cfg.vocab_size
        self._requests: dict[str, Request] = {}
        self._seed_counter = itertools.count(config.seed * 1_000_003)
        self.last_step = StepStats()

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=False) or []
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt", "must be a string or a list of token ids")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if not isinstance(out, list) else out)

    def _validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                "prompt", f"{len(prompt_ids)} tokens; this model's context holds {self.max_model_len} "
                          "including at least one generated token")

    def _new_generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else next(self._seed_counter)
        return torch.Generator().manual_seed(seed)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0, prefill_only: bool = False, arrival_time: float | None = None,
                    urgent: bool = False, cache_salt: str | None = None) -> None:
        """Queue a request. `prefill_only`: stop after the first token and keep the KV blocks for
        export (disaggregated prefill); release them with `release_prefilled`. Within a priority,
        requests run in order of `arrival_time` (`time.monotonic()` clock; default now): a request
        that arrived earlier elsewhere, e.g. one resumed after its worker died, goes ahead.
        `urgent`: a step that admits it admits no later new prompt that is not urgent too (a recompute
        whose client is waiting gets a short step, not one filled up to the token budget).
        `cache_salt`: this request shares prefix-cache entries only with requests of the same salt."""
        params = params if params is not None else SamplingParams()
        prompt_ids = self.encode_prompt(prompt)
        self._validate(request_id, prompt_ids, params)
        params.check_token_ids(self.vocab_size)
        check_cache_salt(cache_salt)
        req = Request(request_id, prompt_ids, params, priority=priority, prefill_only=prefill_only,
                      urgent=urgent, generator=self._new_generator(params), cache_salt=cache_salt)
        if arrival_time is not None:
            req.arrival_time = min(arrival_time, req.arrival_time)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. Returns False if unknown."""
        req = self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        return req is not None

    # ------------------------------------------------------------------ disaggregation hooks
    def release_prefilled(self, request_id: str) -> bool:
        """Free the KV blocks a prefill-only request kept for export."""
        self._requests.pop(request_id, None)
        return self.scheduler.release_prefilled(request_id)

    def prefilled_block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.prefilled[request_id].block_table)

    def allocate_blocks(self, num_tokens: int, contiguous: bool = False) -> list[int] | None:
        """Blocks to receive `num_tokens` tokens of imported KV, or None if they are not free.
        `contiguous`: one run of consecutive ids if the pool has one (else any free blocks)."""
        n = self.block_manager.blocks_for_tokens(num_tokens)
        if not self.block_manager.can_allocate(n):
            return None
        if contiguous:
            run = self.block_manager.allocate_contiguous(n)
            if run is not None:
                return run
        return self.block_manager.allocate(n)

    def free_blocks(self, block_ids: list[int]) -> None:
        self.block_manager.free(block_ids)

    def pin_computed_blocks(self, request_id: str, max_tokens: int, first_block: int = 0) -> list[int]:
        """A reference on each full block of `request_id`'s first `max_tokens` tokens whose KV is
        computed, from block `first_block` on, so it survives the request (to export a copy);
        `free_blocks` drops it. [] if there is none or the request is not running here."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return []
        n = min(max_tokens, req.num_computed_tokens) // self.block_manager.block_size
        block_ids = list(req.block_table[first_block:n])
        self.block_manager.incref(block_ids)
        return block_ids

    def take_cached_blocks(self, token_ids: list[int], max_tokens: int | None = None,
                           cache_salt: str | None = None) -> list[int]:
        """A reference on each cached block of the longest cached prefix of `token_ids` (full blocks,
        at most `max_tokens` tokens), so it can be exported (a decode worker fetching a prefix this
        engine holds); `free_blocks` drops it. [] when nothing is cached."""
        if not self.config.enable_prefix_caching:
            return []
        bs = self.block_manager.block_size
        n = len(token_ids[:max_tokens]) // bs
        block_ids = self.block_manager.lookup(extend_block_keys([], token_ids, n, bs, cache_salt)) if n else []
        self.block_manager.take(block_ids)
        return block_ids

    def cache_blocks(self, token_ids: list[int], block_ids: list[int], first_block: int = 0,
                     cache_salt: str | None = None) -> int:
        """Imported KV into the prefix cache: `block_ids` (from `allocate_blocks`) hold the full blocks
        `first_block`, `first_block` + 1, ... of `token_ids`. Each is registered under its key (unless
        that key is cached already), then freed: cached and free, like a finished request's blocks.
        Returns how many were registered."""
        bs = self.block_manager.block_size
        keys = extend_block_keys([], token_ids, first_block + len(block_ids), bs, cache_salt)[first_block:]
        assert len(keys) == len(block_ids), f"{len(block_ids)} blocks but {len(keys)} full blocks of tokens"
        before = self.block_manager.num_cached_blocks
        if self.config.enable_prefix_caching:
            for b, key in zip(block_ids, keys):
                self.block_manager.register(b, key)
        self.block_manager.free(block_ids)
        return self.block_manager.num_cached_blocks - before

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                              params: SamplingParams, block_ids: list[int], num_computed_tokens: int,
                              priority: int = 0, generator_state: torch.Tensor | None = None,
                              cache_salt: str | None = None) -> None:
        """Resume decoding a request whose first `num_computed_tokens` tokens of KV are already in
        `block_ids` (allocated with `allocate_blocks`). The engine owns the blocks from now on."""
        check_cache_salt(cache_salt)
        req = Request(request_id, list(prompt_token_ids), params, priority=priority,
                      generator=self._new_generator(params), cache_salt=cache_salt)
        if generator_state is not None and req.generator is not None:
            req.generator.set_state(generator_state)
        req.output_token_ids = list(output_token_ids)
        req.block_table = list(block_ids)
        req.num_computed_tokens = num_computed_tokens
        assert num_computed_tokens < req.num_tokens, "nothing left to decode"
        self._requests[request_id] = req
        self.scheduler.add_running(req)

    # ------------------------------------------------------------------ the loop
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens still to compute (waiting requests and unfinished prefill chunks): how far
        behind a new prompt would start here."""
        s = self.scheduler
        return (sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
                + sum(n for r in s.running if (n := r.num_tokens - r.num_computed_tokens) > 1))

    @torch.inference_mode()
    def step(self, forward: contextlib.AbstractContextManager | None = None) -> list[RequestOutput]:
        """One step. `forward`: entered around the model's forward pass only, which touches no request
        and no block-manager state (a worker lets a narrow block-manager call run meanwhile)."""
        t0 = time.perf_counter()
        cached_before = self.scheduler.num_cached_tokens
        sched = self.scheduler.schedule()
        if sched.empty:
            self.last_step = StepStats()
            return []
        with forward or contextlib.nullcontext():
            logits = self.runner.run(sched)
        outputs = self._postprocess(sched, logits)
        self.last_step = StepStats(
            num_prefill_tokens=sum(c.num_new_tokens for c in sched.chunks if c.num_new_tokens > 1),
            num_decode_tokens=sum(1 for c in sched.chunks if c.num_new_tokens == 1),
            num_seqs=len(sched.chunks), num_preempted=len(sched.preempted),
            num_cached_tokens=self.scheduler.num_cached_tokens - cached_before, duration_s=time.perf_counter() - t0)
        return outputs

    def _postprocess(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        sampling = [c.request for c in sched.chunks if c.samples]
        result = sample(logits, sampling, self.eos_token_ids) if sampling else SampleResult([], {})
        for chunk in sched.chunks:
            self.scheduler.postprocess_chunk(chunk)
        outputs = []
        for i, (req, tok) in enumerate(zip(sampling, result.token_ids)):
            # NOTE: a request can fail only itself: what goes wrong in its own row ends it alone.
            if i in result.errors:
                outputs.append(self._fail(req, result.errors[i]))
                continue
            try:
                outputs.append(self._append_token(req, tok))
            except Exception as exc:  # noqa: BLE001 - its stop strings, its detokenization
                logger.exception("request %s failed in postprocessing", req.request_id)
                outputs.append(self._fail(req, f"postprocessing failed: {type(exc).__name__}"))
        return outputs

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """End `req` alone with finish_reason "error"; its blocks are freed as for any finished request."""
        if not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self._requests.pop(req.request_id, None)
        return RequestOutput(request_id=req.request_id, new_token_ids=[], token_ids=list(req.output_token_ids),
                             finished=True, finish_reason=RequestStatus.FINISHED_ERROR.value, text=req.output_text,
                             num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                             error=error)

    def _append_token(self, req: Request, tok: int) -> RequestOutput:
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        new_ids: list[int] = []
        status: RequestStatus | None = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok
        else:
            req.output_token_ids.append(tok)
            new_ids.append(tok)
            if p.stop and self._hit_stop_string(req):
                status = RequestStatus.FINISHED_STOPPED
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            elif req.prefill_only:
                status = RequestStatus.PREFILLED
        block_ids = None
        if status is not None:
            if status is RequestStatus.PREFILLED:
                block_ids = list(req.block_table)
            self.scheduler.finish(req, status)
            if status is not RequestStatus.PREFILLED:
                self._requests.pop(req.request_id, None)
            if not isinstance(req.stop_reason, str):  # text cut at a stop string stays cut
                req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, token_ids=list(req.output_token_ids),
            finished=status is not None, finish_reason=None if status is None else status.value,
            text=req.output_text if status is not None else "", num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, block_ids=block_ids)

    def _new_text(self, req: Request) -> str:
        """The text the newest tokens add, decoding only them and a little context before them (never
        the whole output again). "" while they end inside a multi-byte character."""
        ids = req.output_token_ids
        before = self.tokenizer.decode(ids[req.detok_prefix:req.detok_read], skip_special_tokens=True)
        text = self.tokenizer.decode(ids[req.detok_prefix:], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        req.detok_prefix, req.detok_read = req.detok_read, len(ids)
        return text[len(before):]

    def _hit_stop_string(self, req: Request) -> bool:
        new = self._new_text(req)
        if not new:
            return False
        longest = max(len(s) for s in req.params.stop)
        # Only a stop string that ends in the new text can be new.
        window_start = max(0, len(req.output_text) - longest + 1)
        req.output_text += new
        cut = None
        for s in req.params.stop:
            i = req.output_text.find(s, window_start)
            if i != -1 and (cut is None or i < cut):
                cut, req.stop_reason = i, s
        if cut is not None:
            req.output_text = req.output_text[:cut]
        return cut is not None

    def check_integrity(self) -> None:
        """Raise AssertionError on a leaked or doubly owned KV block."""
        self.block_manager.check_integrity()
        owned = [b for r in self.scheduler.running + list(self.scheduler.prefilled.values()) for b in r.block_table]
        assert len(owned) == len(set(owned)), "a KV block is owned by two requests"
        for r in self.scheduler.waiting:
            assert not r.block_table, f"waiting request {r.request_id} holds blocks"


class LLM:
    """Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order. Invalid input raises before anything is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params", "give one per prompt, or one for all")
        engine = self.engine
        # Validate every prompt first so a bad one leaves nothing queued.
        encoded = [engine.encode_prompt(p) for p in prompts]
        for ids, sp in zip(encoded, params):
            engine._validate("__check__", ids, sp)
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, ids, sp in zip(rids, encoded, params):
            engine.add_request(rid, ids, sp)
        results: dict[str, RequestOutput] = {}
        engine.scheduler.draining = True
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate")
        try:
            while len(results) < len(rids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar:
                            bar.update(1)
        finally:
            engine.scheduler.draining = False
            if bar:
                bar.close()
        return [results[r] for r in rids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.engine.apply_chat_template(m) for m in convs], sampling_params)
