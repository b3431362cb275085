"""Models for benchmarks/gpu_engine.py: real models' shapes with random weights, built on the device;
SmolLM2's tokenizer; the patch that hands a prebuilt model to `LLMEngine`; the burst workload; and
transformers' own baselines (continuous batching, static-cache `generate`) on the same model.

NOTE: gpu_engine.py loads this file by its path, also in a process whose `engine` package is an older
checkout (`--old-tree`): it imports only torch, transformers and, inside functions, the names that
every version of `engine` has (`engine.llm_engine.load_model_and_tokenizer`, `engine.model_loader`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import time
from typing import Any, Iterator

import torch

# Llama-3.1's long-context rotary scaling, as its config.json has it.
LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}

# transformers config kwargs per shape; vocab_size None means the tokenizer's.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=None, tie_word_embeddings=False,
                 rope_theta=10000.0, max_position_embeddings=4096),
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192),
    # 8 of Llama-3.1-8B's 32 layers: every per-layer shape and the full vocabulary, in ~6 GB of bf16.
    "llama3-8b-8layers": dict(num_hidden_layers=8, hidden_size=4096, intermediate_size=14336,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                              tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
                              max_position_embeddings=131072),
}
TOKENIZER_ENV = "PDSERVE_TEST_TOKENIZER"


def load_tokenizer(tokenizer_dir: str | None = None):
    """SmolLM2's tokenizer: from `tokenizer_dir` or $PDSERVE_TEST_TOKENIZER (a `save_pretrained` dir, the
    only source on a GPU machine), else from the default model's package."""
    from transformers import AutoTokenizer

    tokenizer_dir = tokenizer_dir or os.environ.get(TOKENIZER_ENV)
    if tokenizer_dir:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    import engine.model_loader as loader

    if hasattr(loader, "load_tokenizer"):
        return loader.load_tokenizer(None)
    return loader.load_model_and_tokenizer(None)[1]


def build_model(shape: str, tokenizer, device: str, dtype: torch.dtype, seed: int = 0):
    """A Llama of `shape` with random weights, made directly on `device` in `dtype` (nothing read from
    disk or the hub)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape])
    spec["vocab_size"] = spec["vocab_size"] or len(tokenizer)
    cfg = AutoConfig.for_model("llama", rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def shape_summary(model) -> dict[str, Any]:
    cfg = model.config
    return {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
            "tied": bool(cfg.tie_word_embeddings), "dtype": str(model.dtype),
            "rope": getattr(cfg, "rope_parameters", None) or {"theta": getattr(cfg, "rope_theta", None),
                                                               "scaling": getattr(cfg, "rope_scaling", None)},
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}


@contextlib.contextmanager
def engine_uses(model, tokenizer, name: str) -> Iterator[None]:
    """While open, `LLMEngine(...)` takes `model` instead of loading `config.model`. The engine's own
    dtype/device request is honoured (`.to`, a no-op when they match: the CPU's bf16 path asks fp32)."""
    import engine.llm_engine as llm_engine

    real = llm_engine.load_model_and_tokenizer

    def prebuilt(spec=None, dtype: str = "float32", device: str = "cpu", *args, **kwargs):
        return model.to(device=device, dtype=getattr(torch, dtype)).eval(), tokenizer, name

    llm_engine.load_model_and_tokenizer = prebuilt
    try:
        yield
    finally:
        llm_engine.load_model_and_tokenizer = real


def make_burst(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
               vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request, lengths uniform over the inclusive ranges. Ids start
    at 100: no special tokens in a prompt."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt = [rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))]
        out.append((prompt, rng.randint(*output_range)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_static_generate(model, prompt_ids: list[int], new_tokens: int, pad_id: int) -> dict[str, Any]:
    """transformers' `generate` at batch 1 with a static cache (on CUDA it compiles the forward itself):
    one untimed call of the same shapes (compilation, graph capture), then the timed one."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt_ids], device=model.device)
    gcfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                            eos_token_id=None, pad_token_id=pad_id)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gcfg)
    _sync(model.device)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gcfg)
    _sync(model.device)
    wall = time.perf_counter() - t0
    made = out.shape[1] - ids.shape[1]
    if made != new_tokens:
        raise RuntimeError(f"static-cache generate made {made} of {new_tokens} tokens")
    return {"name": "HF generate, static cache", "batch": 1, "prompt_tokens": len(prompt_ids),
            "new_tokens": made, "wall_s": wall, "ms_per_token": 1e3 * wall / made,
            "output_tok_s": made / wall, "warmup_s_not_counted": warm_s}


def _cb_kwargs(model, gcfg, max_seqs: int, max_batch_tokens: int, burst) -> dict[str, Any]:
    """`continuous_batching_context_manager`'s arguments for the installed transformers (its knobs
    moved between 5.x releases: pass only what this one takes)."""
    params = inspect.signature(model.continuous_batching_context_manager).parameters
    kwargs: dict[str, Any] = {"generation_config": gcfg, "block": True, "timeout": 30}
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None
    if ContinuousBatchingConfig is not None and "continuous_batching_config" in params:
        # NOTE: a KV pool for twice the whole burst at once, so nothing waits for room: left to itself it
        # sizes the pool by free memory, and zeroing that took 16 s of a 2-core host (set-up, not counted).
        page = getattr(ContinuousBatchingConfig(), "page_size", None) or 256
        knobs = dict(max_requests_per_batch=max_seqs, max_batch_tokens=max_batch_tokens,
                     num_blocks=2 * sum(-(-(len(p) + n) // page) for p, n in burst) + 16)
        accepted = inspect.signature(ContinuousBatchingConfig).parameters
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            **{k: v for k, v in knobs.items() if k in accepted})
    else:  # older releases read the knobs off the generation config
        gcfg.max_batch_tokens = max_batch_tokens
    if "workload_hints" in params:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p, _ in burst),
                                                 max_generated_length=max(n for _, n in burst),
                                                 num_requests=len(burst))
    return {k: v for k, v in kwargs.items() if k in params}


def hf_continuous_burst(model, burst: list[tuple[list[int], int]], max_seqs: int, max_batch_tokens: int,
                        pad_id: int) -> dict[str, Any]:
    """transformers' continuous batching on the burst, each request with its own max_new_tokens; its
    start-up (cache allocation, warm-up) is timed apart and not counted.

    NOTE: not under inference_mode: the manager updates its buffers in place on its own thread."""
    from transformers import GenerationConfig

    gcfg = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in burst), eos_token_id=-1,
                            pad_token_id=pad_id)
    kwargs = _cb_kwargs(model, gcfg, max_seqs, max_batch_tokens, burst)
    attn_before = model.config._attn_implementation
    t_setup = time.perf_counter()
    try:
        with model.continuous_batching_context_manager(**kwargs) as manager:
            setup_s = time.perf_counter() - t_setup
            t0 = time.perf_counter()
            rids = [manager.add_request(p, request_id=f"req-{i}", max_new_tokens=n) for i, (p, n) in enumerate(burst)]
            if None in rids:
                raise RuntimeError("transformers' continuous batching manager refused a request")
            results: dict[str, Any] = {}
            while len(results) < len(rids):
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished():
                    results[res.request_id] = res
                elif res is None and not manager.is_running():
                    raise RuntimeError(f"transformers' continuous batching loop died after {len(results)} results")
            _sync(model.device)
            wall = time.perf_counter() - t0
            # What it ran with (its defaults resolve at start: CUDA graphs, compile, async batching, attention).
            cb_config = getattr(manager, "continuous_batching_config", None) or getattr(manager, "cb_config", None)
            ran_with = {"attn_implementation": model.config._attn_implementation, "arguments": sorted(kwargs),
                        "config": repr(cb_config)[:2000]}
    finally:
        if model.config._attn_implementation != attn_before:  # it may switch implementations
            model.set_attn_implementation(attn_before)
    produced = sum(min(len(results[rid].generated_tokens), n) for rid, (_, n) in zip(rids, burst))
    if produced == 0:
        raise RuntimeError("transformers' continuous batching produced no tokens (see its log above)")
    return {"name": "HF continuous batching", "requests": len(burst), "output_tokens": produced,
            "requested_tokens": sum(n for _, n in burst), "wall_s": wall, "output_tok_s": produced / wall,
            "setup_s_not_counted": setup_s, "ran_with": ran_with}
