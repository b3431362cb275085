"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` over one `LLMEngine`."""

from __future__ import annotations

import itertools
from typing import Sequence

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`. With
    `tensor_parallel_size=N` > 1 the model is split over N processes on this host
    (`engine.parallel.launch_local`); `close()` (or leaving a `with LLM(...) as llm:` block) stops them."""

    def __init__(self, model: str | None = None, **kwargs):
        config = EngineConfig(model=model, **kwargs)
        if config.tensor_parallel_size > 1:
            from engine.parallel import launch_local

            self.engine = launch_local(config)
        else:
            self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order, each with all its logprobs (and prompt logprobs) when asked.
        Invalid input raises before anything is queued."""
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
            sp.check_token_ids(engine.vocab_size)
            engine.grammars.state_for(sp)  # a grammar that does not compile (cached for add_request)
        rids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, ids, sp in zip(rids, encoded, params):
            engine.add_request(rid, ids, sp)
        results: dict[str, RequestOutput] = {}
        # The engine's outputs carry this step's logprobs only (and the prompt's on the first): collected here.
        logprobs: dict[str, list] = {rid: [] for rid, sp in zip(rids, params) if sp.logprobs is not None}
        prompt_logprobs: dict[str, list] = {}
        engine.scheduler.draining = True
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate")
        try:
            while len(results) < len(rids):
                for out in engine.step():
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.request_id in logprobs:
                        logprobs[out.request_id].extend(out.logprobs or [])
                    if out.finished:
                        out.logprobs = logprobs.get(out.request_id)
                        out.prompt_logprobs = prompt_logprobs.get(out.request_id)
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
