"""Loading a model and building its runner for one `EngineConfig`: shared by `LLMEngine` (rank 0) and a
tensor-parallel follower (engine/parallel/worker.py), so every rank builds the same runner."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, kv_cache_torch_dtype
from engine.kv_pool import kv_pool_blocks
from engine.model_loader import load_model_and_tokenizer
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup


def load_model(config: EngineConfig, loader=load_model_and_tokenizer):
    """(hf_model, tokenizer, model_dir, matmul_dtype); `loader`: `load_model_and_tokenizer` or a stand-in.

    NOTE: bf16 on a CPU: the linear layers multiply in bf16 (AMX / AVX512-BF16 hardware, several
    times fp32's rate), everything else (norms, rotary, decode attention, the residual stream)
    computes in fp32 over a bf16 KV cache, where the compiled kernels run (prefill attention and
    the products' inputs are bf16); all-bf16 activations fell back to gather + SDPA and
    elementwise bf16 ops, 1.4x slower per decode step (README "dtype on CPU")."""
    on_cpu = torch.device(config.device).type == "cpu"
    matmul_dtype = torch.bfloat16 if config.dtype == "bfloat16" and on_cpu else None
    hf_model, tokenizer, model_dir = loader(
        config.model, "float32" if matmul_dtype else config.dtype, config.device, config.cache_dir)
    return hf_model, tokenizer, model_dir, matmul_dtype


def build_runner(config: EngineConfig, hf_model, matmul_dtype: torch.dtype | None, tp: TPGroup) -> ModelRunner:
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
    return ModelRunner(hf_model, num_blocks, config.block_size, config.device, kv_dtype, matmul_dtype,
                       ops_backend=config.ops_backend, cuda_graphs=config.cuda_graphs,
                       max_num_seqs=config.max_num_seqs, max_model_len=min(limits),
                       num_speculative_tokens=num_spec, tp=tp)
