"""The engine loop (`LLMEngine`: add_request / step / abort); the offline API is `engine.offline.LLM`."""

from __future__ import annotations

import contextlib
from concurrent import futures
import itertools
import logging
import time
from dataclasses import dataclass, replace
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, schema_limits
from engine.errors import EngineConfigError, InvalidRequestError, PromptTooLongError, invalid_request_text
from engine.host_memory import keep_freed_memory
from engine.logprobs import attach_logprobs, record_prompt_logprobs
from engine.model_loader import load_model_and_tokenizer
from engine.model_setup import build_runner, load_model
from engine.parallel.group import TPGroup
from engine.request import Request, RequestOutput, RequestStatus
from engine.device_sampler import sample_on_device
from engine.sampler import SampleResult
from engine.stop_strings import hit_stop_string
from engine.sampling_params import SamplingParams, check_cache_salt, check_tenant
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engine.spec.speculator import Speculator, SpecStats
from engine.grammar_waits import GrammarWait, GrammarWaitLog
from engine.structured import GrammarCache, GrammarJob

logger = logging.getLogger(__name__)
GRAMMAR_IDLE_WAIT_S = 0.02  # a step with nothing but pending grammars waits this long for one

Prompt = str | list[int]


def _resumed_tail(prompt_ids: list[int], num_resumed_output: int) -> list[int]:
    """The prompt's last `num_resumed_output` tokens: a resumed request's earlier output."""
    if not isinstance(num_resumed_output, int) or not 0 <= num_resumed_output < max(len(prompt_ids), 1):
        raise InvalidRequestError("num_resumed_output", f"must be in [0, {len(prompt_ids)}), got {num_resumed_output!r}")
    return list(prompt_ids[len(prompt_ids) - num_resumed_output:]) if num_resumed_output else []


@dataclass(slots=True)
class _AwaitingGrammar:
    """A request parked until its grammar compiles, and how to admit it then."""

    request: Request
    job: GrammarJob
    grammar_prefix: list[int]  # tokens the grammar accepts before the request's next one
    admit: object  # Scheduler.add or Scheduler.add_running
    since: float  # time.time() it began waiting (its GrammarWait)


@dataclass(slots=True)
class StepStats:
    """What the last step did; the serving layer reports it to the router."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    num_preempted: int = 0
    num_cached_tokens: int = 0  # prompt tokens requests admitted in this step took from the prefix cache
    duration_s: float = 0.0
    num_draft_tokens: int = 0  # speculative drafts verified (counted in num_decode_tokens too)
    num_accepted_tokens: int = 0  # of those, accepted


class LLMEngine:
    """One model on one device with a paged KV cache and a token-budget scheduler.

    `step()` is `schedule -> run -> postprocess`; everything else manages requests.
    """

    def __init__(self, config: EngineConfig | None = None, tp_group: TPGroup | None = None, **overrides):
        """`tp_group`: rank 0 of a tensor-parallel group whose followers run `engine.parallel.run_follower`
        (`engine.parallel.launch_local` builds both); None: one device."""
        config = replace(config or EngineConfig(), **overrides) if overrides else (config or EngineConfig())
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if torch.device(config.device).type == "cpu":
            keep_freed_memory()  # activations stay in the heap between steps (engine/host_memory.py)
        tp = tp_group or TPGroup.single()
        if config.tensor_parallel_size != tp.world or tp.rank != 0:
            raise EngineConfigError(
                f"tensor_parallel_size={config.tensor_parallel_size} needs its follower ranks: build the engine with "
                "engine.parallel.launch_local(config) (or LLM(..., tensor_parallel_size=N)), which starts them"
                if tp_group is None else
                f"tensor_parallel_size={config.tensor_parallel_size}, but tp_group is rank {tp.rank} of {tp.world} "
                "(LLMEngine runs on rank 0 of a group of that size)")
        # NOTE: the loader by this module's name: benchmarks/gpu_shapes.py swaps in a prebuilt model there.
        self.hf_model, self.tokenizer, self.model_dir, matmul_dtype, weights = load_model(
            config, load_model_and_tokenizer, tp)
        hf_cfg = self.hf_model.config
        self.runner = build_runner(config, self.hf_model, matmul_dtype, tp, weights)
        num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.max_model_len = self.runner.max_model_len
        eos = set()
        for src in (self.hf_model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(src, int):
                eos.add(src)
            elif src:
                eos.update(src)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = hf_cfg.vocab_size
        self._requests: dict[str, Request] = {}
        self._on_close: list = []  # called by close() (engine.parallel.launch_local: join the followers)
        self.follower_pids: list[int] = []  # tensor parallelism: the follower processes launch_local started
        self._seed_counter = itertools.count(config.seed * 1_000_003)
        self.last_step = StepStats()
        self._step_accepted = 0  # drafts accepted in the step being postprocessed
        self.speculator = Speculator(config) if config.speculative_method != "off" else None
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                     max_bytes=config.grammar_cache_mb << 20, workers=config.grammar_compile_workers,
                                     timeout_s=config.grammar_compile_timeout_s, limits=schema_limits(config))
        # Requests waiting for their grammar to compile (off this thread): not in the scheduler, so no
        # step waits for them; `_admit_compiled` moves each in once its grammar is ready.
        self._awaiting_grammar: dict[str, _AwaitingGrammar] = {}
        self.grammar_waits: GrammarWaitLog | None = None  # `watch_grammar_waits`: how long each request waited
        # The requests the last step scheduled (None: it failed before scheduling): a step that raises
        # ends only these (deployments/engine_host.py's owners read it).
        self.step_request_ids: list[str] | None = []

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

    def _new_sample_seed(self, params: SamplingParams) -> int | None:
        """The key of a sampled request's draws (engine.device_sampler): its seed, or the engine's next."""
        if params.greedy:
            return None
        return params.seed if params.seed is not None else next(self._seed_counter)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0, prefill_only: bool = False, arrival_time: float | None = None,
                    urgent: bool = False, cache_salt: str | None = None, num_resumed_output: int = 0,
                    tenant: str | None = None, tenant_weight: float = 1.0) -> None:
        """Queue a request. `prefill_only`: stop after the first token and keep the KV blocks for
        export (disaggregated prefill); release them with `release_prefilled`. Within a priority,
        requests run in order of `arrival_time` (`time.monotonic()` clock; default now): a request
        that arrived earlier elsewhere, e.g. one resumed after its worker died, goes ahead.
        `urgent`: a step that admits it admits no later new prompt that is not urgent too (a recompute
        whose client is waiting gets a short step, not one filled up to the token budget).
        `cache_salt`: this request shares prefix-cache entries only with requests of the same salt.
        `num_resumed_output`: the prompt ends with this many tokens the request generated before it
        moved here (its grammar and output penalties continue after them).
        `tenant` / `tenant_weight`: who sent it and that tenant's share; with tenants the scheduler
        orders the queue by weighted fair queueing and preempts the heaviest tenant (engine/fair_share.py).
        `priority` (lower runs first) only under `scheduling_policy="priority"`; under "fcfs" a
        non-zero one is refused rather than ignored."""
        params = params if params is not None else SamplingParams()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority", "must be an integer")
        if priority and self.config.scheduling_policy == "fcfs":
            raise InvalidRequestError("priority", "this server schedules first come, first served "
                                                  "(scheduling_policy=fcfs): leave priority at 0")
        prompt_ids = self.encode_prompt(prompt)
        self._validate(request_id, prompt_ids, params)
        params.check_token_ids(self.vocab_size)
        check_cache_salt(cache_salt)
        check_tenant(tenant, tenant_weight)
        resumed = _resumed_tail(prompt_ids, num_resumed_output)
        req = Request(request_id, prompt_ids, params, priority=priority, prefill_only=prefill_only,
                      urgent=urgent, sample_seed=self._new_sample_seed(params), cache_salt=cache_salt,
                      num_resumed_output=len(resumed), tenant=tenant, tenant_weight=float(tenant_weight))
        if arrival_time is not None:
            req.arrival_time = min(arrival_time, req.arrival_time)
        self.admit_with_grammar(req, resumed, self.scheduler.add)

    def admit_with_grammar(self, req: Request, grammar_prefix: list[int], admit) -> None:
        """Hand `req` to `admit` (a scheduler method) now if it has no grammar or its grammar is compiled;
        else park it until the grammar is ready (`step` admits it then). Raises InvalidRequestError
        at once for a spec known not to compile. `grammar_prefix`: tokens its grammar must accept first."""
        spec = req.params.structured
        since = time.time()
        job = self.grammars.submit(spec) if spec is not None else None
        if job is not None and not job.future.done():
            self._requests[req.request_id] = req
            self._awaiting_grammar[req.request_id] = _AwaitingGrammar(req, job, grammar_prefix, admit, since)
            return
        try:
            if job is not None:
                req.grammar = self.grammars.state_from(job.future.result(), spec, grammar_prefix, req.params.min_tokens)
        except InvalidRequestError as exc:
            self._note_wait(req.request_id, job, since, "known_invalid" if job.from_cache else "invalid",
                            invalid_request_text(exc.field, exc.message))
            raise
        finally:
            if job is not None:
                self.grammars.release(job)
        if job is not None:
            self._note_wait(req.request_id, job, since)
        self._requests[req.request_id] = req
        admit(req)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Move requests whose grammar is ready into the scheduler; end those whose grammar failed or ran
        past its time budget (each alone, naming its field). Their outputs."""
        failed: list[RequestOutput] = []
        now = time.monotonic()
        for rid, w in list(self._awaiting_grammar.items()):
            job, spec = w.job, w.request.params.structured
            if not job.future.done():
                if now - job.submitted_at <= self.grammars.timeout_s:
                    continue
                error: str | None = invalid_request_text(spec.field, self.grammars.too_slow_message)
            else:
                try:
                    w.request.grammar = self.grammars.state_from(job.future.result(), spec, w.grammar_prefix,
                                                                 w.request.params.min_tokens)
                    error = None
                except InvalidRequestError as exc:
                    error = invalid_request_text(exc.field, exc.message)
            del self._awaiting_grammar[rid]
            self.grammars.release(job)
            self._note_wait(rid, job, w.since, None if error is None else "invalid" if job.future.done() else "timeout",
                            error)
            if error is None:
                w.admit(w.request)
            else:
                failed.append(self._fail_unscheduled(w.request, error))
        return failed

    def watch_grammar_waits(self) -> GrammarWaitLog:
        """Note each structured request's wait for its grammar from now on (engine/grammar_waits.py); the
        caller drains the returned log (`take`), e.g. after each step."""
        if self.grammar_waits is None:
            self.grammar_waits = GrammarWaitLog()
        return self.grammar_waits

    def _note_wait(self, request_id: str, job: GrammarJob, since: float, error_cause: str | None = None,
                   error: str | None = None) -> None:
        if self.grammar_waits is None:
            return
        started, finished = job.started_at, job.finished_at
        self.grammar_waits.note(GrammarWait(
            request_id, job.spec.kind, job.from_cache, since, time.time(),
            None if started is None else started - job.submitted_at,
            None if started is None or finished is None else finished - started, error_cause, error))

    def _fail_unscheduled(self, req: Request, error: str) -> RequestOutput:
        """End a request the scheduler never saw (it waited for its grammar); its blocks (a prefilled
        request brings some) go back."""
        req.status = RequestStatus.FINISHED_ERROR
        if req.block_table:
            self.block_manager.free(req.block_table)
            req.block_table = []
        self._requests.pop(req.request_id, None)
        return RequestOutput(request_id=req.request_id, new_token_ids=[], token_ids=[], finished=True,
                             finish_reason=RequestStatus.FINISHED_ERROR.value, num_prompt_tokens=req.num_prompt_tokens,
                             error=error)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. Returns False if unknown."""
        waiting = self._awaiting_grammar.pop(request_id, None)
        if waiting is not None:  # its compile is cancelled if nobody else waits for it and it has not started
            self.grammars.release(waiting.job)
            self._note_wait(request_id, waiting.job, waiting.since, "aborted")
            self._fail_unscheduled(waiting.request, "aborted")
            waiting.request.status = RequestStatus.FINISHED_ABORTED
            return True
        req = self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        if req is not None:
            self._ended(req)
        return req is not None

    def _ended(self, req: Request) -> None:
        """`req` left the engine (finished, failed or aborted; not prefilled for export)."""
        if self.speculator is not None:
            self.speculator.finish(req)

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counters since the engine started (zeros when it is off)."""
        if self.speculator is None:
            return SpecStats(self.config.speculative_method)
        return replace(self.speculator.stats)

    # ------------------------------------------------------------------ the loop
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._awaiting_grammar)

    @property
    def num_awaiting_grammar(self) -> int:
        """Requests accepted but waiting for their grammar to compile (not scheduled yet)."""
        return len(self._awaiting_grammar)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._awaiting_grammar)

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
        grammar_failures = self._admit_compiled() if self._awaiting_grammar else []
        cached_before = self.scheduler.num_cached_tokens
        if self.speculator is not None:
            s = self.scheduler
            admitting = bool(s.waiting) and len(s.running) < self.config.max_num_seqs
            self.speculator.propose(s.running, self.max_model_len, admitting)
        t_sched = time.perf_counter()
        self.step_request_ids = None
        sched = self.scheduler.schedule()
        # NOTE: kept until the next step: if this one raises, these are the requests it held.
        self.step_request_ids = [c.request.request_id for c in sched.chunks]
        if sched.empty:
            self.last_step = StepStats()
            if self._awaiting_grammar and not grammar_failures and not self.scheduler.has_unfinished():
                # Only grammars are pending: wait a little for one, so a caller's step loop does not spin.
                futures.wait([w.job.future for w in self._awaiting_grammar.values()], timeout=GRAMMAR_IDLE_WAIT_S,
                             return_when=futures.FIRST_COMPLETED)
            return grammar_failures
        with forward or contextlib.nullcontext():
            logits = self.runner.run(sched)
        record_prompt_logprobs(sched.chunks, logits.prompt_logprobs)
        self._step_accepted = 0
        outputs = self._postprocess(sched, logits.logits)
        duration = time.perf_counter() - t0
        decode = [c for c in sched.chunks if c.num_new_tokens == 1 or c.num_spec]
        num_decode = sum(c.num_new_tokens for c in decode)
        # NOTE: the cost model learns from decode-only steps: drafts are decode tokens, and a prompt
        # token costs less than a decode token (one wide GEMM), so mixed steps would make drafts look
        # cheap. Proposing is left out: its cost is per sequence, and its first call for a sequence
        # (indexing the whole prompt) is a one-off that once passed for the price of the drafts.
        if self.speculator is not None and num_decode == sched.num_batched_tokens:
            self.speculator.record_step(num_decode, time.perf_counter() - t_sched)
        self.last_step = StepStats(
            num_prefill_tokens=sched.num_batched_tokens - num_decode, num_decode_tokens=num_decode,
            num_seqs=len(sched.chunks), num_preempted=len(sched.preempted),
            num_cached_tokens=self.scheduler.num_cached_tokens - cached_before, duration_s=duration,
            num_draft_tokens=sum(c.num_spec for c in decode), num_accepted_tokens=self._step_accepted)
        return grammar_failures + outputs if grammar_failures else outputs

    def _postprocess(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        sampling = [c for c in sched.chunks if c.samples]
        requests = [c.request for c in sampling]
        drafts = [c.request.spec_token_ids[:c.num_spec] for c in sampling] if self.speculator else None
        result = sample_on_device(logits, requests, self.eos_token_ids, drafts) if sampling else SampleResult([], {})
        for chunk in sched.chunks:
            if not chunk.num_spec:  # a chunk with drafts is committed once verification has kept some
                self.scheduler.postprocess_chunk(chunk)
        outputs = []
        for i, (chunk, tokens) in enumerate(zip(sampling, result.token_ids)):
            req = chunk.request
            # NOTE: a request can fail only itself: what goes wrong in its own row ends it alone.
            if i in result.errors:
                outputs.append(self._fail(req, result.errors[i]))
                continue
            try:
                out = self._append_token(req, tokens[0]) if not chunk.num_spec else self._append_verified(chunk, tokens)
                outputs.append(attach_logprobs(out, req, (result.logprobs or {}).get(i)))
            except Exception as exc:  # noqa: BLE001 - its stop strings, its detokenization
                logger.exception("request %s failed in postprocessing", req.request_id)
                outputs.append(self._fail(req, f"postprocessing failed: {type(exc).__name__}"))
        return outputs

    def _append_verified(self, chunk: ScheduledChunk, tokens: list[int]) -> RequestOutput:
        """Append what verifying `chunk`'s drafts produced, one token at a time (EOS, a stop string,
        max_tokens or the context limit end the request at that token; the rest are dropped); then
        keep the KV of what was accepted (`Scheduler.commit_verified`). One output for all of them."""
        req = chunk.request
        self.speculator.record_verify(req, chunk.num_spec, len(tokens))
        self._step_accepted += len(tokens) - 1
        new_ids: list[int] = []
        for tok in tokens:
            out = self._append_token(req, tok)
            new_ids.extend(out.new_token_ids)
            if out.finished:
                break
        else:
            self.scheduler.commit_verified(chunk, len(tokens))
        out.new_token_ids = new_ids
        return out

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """End `req` alone with finish_reason "error"; its blocks are freed as for any finished request."""
        if not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        if self._requests.pop(req.request_id, None) is not None:
            self._ended(req)
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
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids) or req.grammar_terminated:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok
        else:
            req.output_token_ids.append(tok)
            new_ids.append(tok)
            if p.stop and hit_stop_string(self.tokenizer, req):
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
                self._ended(req)
            if not isinstance(req.stop_reason, str):  # text cut at a stop string stays cut
                req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, token_ids=list(req.output_token_ids),
            finished=status is not None, finish_reason=None if status is None else status.value,
            text=req.output_text if status is not None else "", num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, block_ids=block_ids)

    def close(self) -> None:
        """Stop this engine's tensor-parallel followers, if any (idempotent). A one-device engine needs
        no closing; its memory goes when it is dropped."""
        self.runner.close()
        for stop in self._on_close:
            stop()
        self._on_close.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError on a leaked or half-owned KV block (`Scheduler.check_integrity`)."""
        self.scheduler.check_integrity()
