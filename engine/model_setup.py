"""Loading a model and building its runner for one `EngineConfig`: shared by `LLMEngine` (rank 0) and a
tensor-parallel follower (engine/parallel/worker.py), so every rank builds the same runner."""

from __future__ import annotations

import threading

import torch

from engine.config import EngineConfig, kv_cache_torch_dtype
from engine.kv_pool import kv_pool_blocks
from engine.model_loader import check_checkpoint, load_model_and_tokenizer, load_tokenizer_dir, resolve_model_dir
from engine.models.checkpoint import SafetensorsTensors
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup


# NOTE: transformers' loading is not thread-safe (from_pretrained patches module construction
# process-wide while it runs): two engines of one process (a TP rank per thread, in tests) load in turn.
_LOAD_LOCK = threading.Lock()


def load_model(config: EngineConfig, loader=load_model_and_tokenizer, tp: TPGroup | None = None):
    """(hf_model, tokenizer, model_dir, matmul_dtype, weights); `loader`: `load_model_and_tokenizer` or a
    stand-in. Under tensor parallelism (`tp`), a checkpoint in safetensors form is not loaded whole:
    `weights` reads the rank's slices from it (`load_shard_skeleton`); otherwise `weights` is None and
    the model is loaded whole, to be sliced.

    NOTE: bf16 on a CPU: the linear layers multiply in bf16 (AMX / AVX512-BF16 hardware, several
    times fp32's rate), everything else (norms, rotary, decode attention, the residual stream)
    computes in fp32 over a bf16 KV cache, where the compiled kernels run (prefill attention and
    the products' inputs are bf16); all-bf16 activations fell back to gather + SDPA and
    elementwise bf16 ops, 1.4x slower per decode step (README "dtype on CPU")."""
    with _LOAD_LOCK:
        return _load_model(config, loader, tp)


def _load_model(config: EngineConfig, loader, tp: TPGroup | None):
    on_cpu = torch.device(config.device).type == "cpu"
    matmul_dtype = torch.bfloat16 if config.dtype == "bfloat16" and on_cpu else None
    dtype = "float32" if matmul_dtype else config.dtype
    if tp is not None and tp.world > 1:
        model_dir = resolve_model_dir(config.model, getattr(torch, dtype), config.cache_dir)
        if SafetensorsTensors.available(model_dir):
            hf_model, tokenizer, weights = load_shard_skeleton(model_dir, getattr(torch, dtype), config.device)
            return hf_model, tokenizer, model_dir, matmul_dtype, weights
    hf_model, tokenizer, model_dir = loader(config.model, dtype, config.device, config.cache_dir)
    return hf_model, tokenizer, model_dir, matmul_dtype, None


# The parameters a rank reads in slices (engine/models/sharding.py); every other one is replicated.
SHARDED_PARAMS = ("q_proj.", "k_proj.", "v_proj.", "o_proj.", "gate_proj.", "up_proj.", "down_proj.",
                  "embed_tokens.", "lm_head.")


@torch.no_grad()
def load_shard_skeleton(model_dir: str, dtype: torch.dtype, device: str):
    """(hf_model, tokenizer, weights) for a tensor-parallel rank, without reading the whole checkpoint:
    the HF model is built on the meta device, its replicated parameters (norms, Qwen3's q/k norms) are
    read from the safetensors files onto `device`, its rotary tables are computed there, and the
    sharded projections stay meta placeholders: `weights` (memory-mapped) gives the rank its slices."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    check_checkpoint(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    weights = SafetensorsTensors(model_dir, dtype, torch.device(device))
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    for name, param in list(hf_model.named_parameters(remove_duplicate=False)):
        if any(f".{p}" in f".{name}" for p in SHARDED_PARAMS):
            continue
        owner, _, attr = name.rpartition(".")
        setattr(hf_model.get_submodule(owner), attr, torch.nn.Parameter(weights.get(name), requires_grad=False))
    inner = hf_model.model
    inner.rotary_emb = type(inner.rotary_emb)(config=cfg).to(device)
    try:
        hf_model.generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the one from_config derived from the config
        pass
    return hf_model.eval(), load_tokenizer_dir(model_dir), weights


def build_runner(config: EngineConfig, hf_model, matmul_dtype: torch.dtype | None, tp: TPGroup,
                 weights=None) -> ModelRunner:
    """The runner (its KV pool included) of rank `tp.rank`. Under tensor parallelism every rank calls
    this in step: the ranks agree on the smallest pool any of them has room for."""
    hf_cfg = hf_model.config
    kv_dtype = getattr(torch, kv_cache_torch_dtype(config.kv_cache_dtype, config.dtype))
    block_bytes = ModelRunner.kv_block_bytes(hf_cfg, config.block_size, kv_dtype, tp.world)
    num_blocks = tp.min_int(kv_pool_blocks(config, hf_cfg, block_bytes, next(hf_model.parameters()).dtype))
    limits = [hf_cfg.max_position_embeddings, num_blocks * config.block_size]
    if config.max_model_len:
        limits.append(config.max_model_len)
    window = getattr(hf_cfg, "sliding_window", None)
    if window and getattr(hf_cfg, "use_sliding_window", True):
        limits.append(window)  # no sliding-window attention yet: stay inside the window
    num_spec = config.num_speculative_tokens if config.speculative_method != "off" else 0
    runner = ModelRunner(hf_model, num_blocks, config.block_size, config.device, kv_dtype, matmul_dtype,
                         ops_backend=config.ops_backend, cuda_graphs=config.cuda_graphs,
                         max_num_seqs=config.max_num_seqs, max_model_len=min(limits),
                         num_speculative_tokens=num_spec, tp=tp, weights=weights)
    if weights is not None:
        weights.close()  # the slices are copied: the files' maps can go
    return runner
