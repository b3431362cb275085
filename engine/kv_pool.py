"""How many KV blocks an engine's pool holds: a block count, a memory budget, or (CUDA) what the GPU has left."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.errors import EngineConfigError

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_MB = 2048
# Room kept for the CUDA graphs' pool, cuBLAS workspaces and the allocator's fragmentation.
GPU_SLACK_BYTES = 768 << 20


def step_activation_bytes(config: EngineConfig, hf_cfg, dtype: torch.dtype) -> int:
    """A generous bound on one step's live activations: a layer's widest tensors at the token budget
    (residual, norm, fused qkv, attention out, gate|up and its product), and fp32 logits for the
    sampled rows and a slice of prompt-logprob rows (with the sampler's copies)."""
    heads = hf_cfg.num_attention_heads
    kv_heads = getattr(hf_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads
    per_token = (4 * hf_cfg.hidden_size + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim
                 + 3 * hf_cfg.intermediate_size)
    elem = torch.empty((), dtype=dtype).element_size()
    logits_rows = config.max_num_seqs * (1 + config.num_speculative_tokens) + 256
    return config.max_num_batched_tokens * per_token * elem + 4 * logits_rows * hf_cfg.vocab_size * 4


def kv_pool_blocks(config: EngineConfig, hf_cfg, block_bytes: int, dtype: torch.dtype) -> int:
    """The pool's block count for `config` (weights already on the device)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    device = torch.device(config.device)
    if config.kv_cache_memory_mb is not None or device.type != "cuda":
        mb = config.kv_cache_memory_mb or CPU_DEFAULT_KV_MB
        return max(1, mb * 2**20 // block_bytes)
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # this engine's weights, and whatever else already holds the device
    budget = int(total * config.gpu_memory_utilization) - in_use - step_activation_bytes(config, hf_cfg, dtype)
    budget -= GPU_SLACK_BYTES
    blocks = budget // block_bytes
    if blocks < 1:
        raise EngineConfigError(
            f"gpu_memory_utilization={config.gpu_memory_utilization}: no room left for a KV pool on {device} "
            f"({in_use / 2**30:.1f} of {total / 2**30:.1f} GiB already in use); raise it, or lower "
            f"max_num_batched_tokens / max_num_seqs")
    logger.info("KV pool: %d blocks (%.1f GiB) from gpu_memory_utilization=%s", blocks, blocks * block_bytes / 2**30,
                config.gpu_memory_utilization)
    return int(blocks)
