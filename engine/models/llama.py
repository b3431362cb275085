"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a paged KV cache.

The weights and the small modules (embedding, norms, rotary tables, Qwen3's q/k norms) are
transformers' own, so any checkpoint transformers loads works and the HF model stays usable as the
reference; the forward pass is ours: tokens of every request packed into one [T] batch without
padding, the per-token ops from an ops backend (engine/ops), the matmuls through `Linear`.

Per layer: add+RMSNorm -> qkv -> rotary + KV store -> paged attention -> o -> add+RMSNorm -> gate|up
-> SiLU x mul -> down. With the Triton backend that is 9 launches a layer.

Under tensor parallelism (`tp`, a world > 1 `engine.parallel.TPGroup`) each rank holds its shard
(engine/models/sharding.py): its q and KV heads, one all-reduce after o and one after down, a slice of
the vocab for the embedding and the lm_head (logits gathered on rank 0). World 1 is the code path
without any of it.
"""

from __future__ import annotations

import torch

from engine.models.linear import Linear, can_prepack
from engine.models.checkpoint import ModuleTensors
from engine.models.sharding import ShardLayout, VocabParallelEmbedding, release, shard_weights
from engine.ops.base import Ops
from engine.ops.torch_ops import TorchOps

# transformers' RMSNorm classes that compute exactly `w * (x * rsqrt(mean(x^2) + eps))` (what the fused
# add+RMSNorm kernels compute); any other norm keeps its own module.
PLAIN_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
_REFERENCE = TorchOps()


class LlamaModel:
    """`forward(ids, positions, meta, kv_cache, ops) -> (h, delta)`, then `logits(ops, h, delta, rows)`."""

    def __init__(self, hf_model, device: torch.device, matmul_dtype: torch.dtype | None = None, tp=None,
                 weights=None):
        """`matmul_dtype`: the dtype of the linear layers' products when it is not the model's (bf16 over
        an fp32 model on CPU: `LLMEngine`); everything else computes in the model's dtype. `tp`: this
        rank's `TPGroup` (None: one device, the whole model). `weights`: where a TP rank reads its
        slices (engine/models/checkpoint.py; None: from `hf_model`'s own modules, released after)."""
        cfg = hf_model.config
        self.config = cfg
        self.dtype = next(hf_model.parameters()).dtype
        self.matmul_dtype = matmul_dtype if matmul_dtype != self.dtype else None
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.scale = self.layers[0].self_attn.scaling
        norms = [n for l in self.layers for n in (l.input_layernorm, l.post_attention_layernorm)] + [self.norm]
        self.plain_norms = all(type(n).__name__ in PLAIN_RMSNORMS and hasattr(n, "variance_epsilon") for n in norms)
        self.vocab_size = cfg.vocab_size
        self.tp = tp if tp is not None and tp.world > 1 else None
        if self.tp is not None:
            self._shard(device, weights or ModuleTensors(hf_model))
            return
        qkv, gate_up = self._fuse_projections()
        self.fuse_silu = getattr(cfg, "hidden_act", None) == "silu" and all(gu is not None for gu in gate_up)
        self._build_linears(qkv, gate_up, can_prepack(device, self.matmul_dtype or self.dtype))

    @torch.no_grad()
    def _fuse_projections(self):
        """One matmul for q/k/v and one for gate/up per layer: fewer, wider GEMMs.

        NOTE: the HF modules' weights become views into the fused tensors, so memory does not grow and
        the HF model (the reference for tests) keeps computing with the very same values."""
        qkv, gate_up = [], []
        for layer in self.layers:
            a = layer.self_attn
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
            nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
            a.q_proj.weight.data, a.k_proj.weight.data, a.v_proj.weight.data = w[:nq], w[nq:nq + nk], w[nq + nk:]
            b = None
            if a.q_proj.bias is not None:
                b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).contiguous()
                a.q_proj.bias.data, a.k_proj.bias.data, a.v_proj.bias.data = b[:nq], b[nq:nq + nk], b[nq + nk:]
            qkv.append((w, b))
            m = layer.mlp
            if m.gate_proj.bias is None and m.up_proj.bias is None and hasattr(m, "act_fn"):
                gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous()
                ni = m.gate_proj.weight.shape[0]
                m.gate_proj.weight.data, m.up_proj.weight.data = gu[:ni], gu[ni:]
                gate_up.append(gu)
            else:
                gate_up.append(None)
        return qkv, gate_up

    @torch.no_grad()
    def _build_linears(self, qkv, gate_up, prepack: bool) -> None:
        md = self.matmul_dtype
        self.lin_qkv = [Linear(w, b, prepack, md) for w, b in qkv]
        self.lin_o = [Linear(l.self_attn.o_proj.weight, l.self_attn.o_proj.bias, prepack, md) for l in self.layers]
        self.lin_gate_up = [None if gu is None else Linear(gu, None, prepack, md) for gu in gate_up]
        self.lin_down = [None if gu is None else Linear(l.mlp.down_proj.weight, l.mlp.down_proj.bias, prepack, md)
                         for gu, l in zip(gate_up, self.layers)]
        self.lin_head = Linear(self.lm_head.weight, getattr(self.lm_head, "bias", None), prepack, md)

    @torch.no_grad()
    def _shard(self, device: torch.device, weights) -> None:
        """This rank's share of the model (`ShardLayout`); the HF modules keep only what is replicated."""
        tp = self.tp
        layout = ShardLayout.of(self.config, tp.world, tp.rank)
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads  # this rank's
        w = shard_weights(weights, self.config, layout, self.head_dim)
        for layer in self.layers:  # the HF copies (or, read from safetensors, meta placeholders)
            a, m = layer.self_attn, layer.mlp
            release(a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        release(self.lm_head, self.embed_tokens)  # (one tensor when the embeddings are tied)
        self.embed_tokens = VocabParallelEmbedding(w.embed, self.vocab_size, tp)
        self.fuse_silu = getattr(self.config, "hidden_act", None) == "silu"
        prepack, md = can_prepack(device, self.matmul_dtype or self.dtype), self.matmul_dtype
        self.lin_qkv = [Linear(wt, b, prepack, md) for wt, b in w.qkv]
        self.lin_o = [Linear(wt, b, prepack, md) for wt, b in w.o]
        self.lin_gate_up = [Linear(wt, b, prepack, md) for wt, b in w.gate_up]
        self.lin_down = [Linear(wt, b, prepack, md) for wt, b in w.down]
        self.lin_head = Linear(*w.head, prepack, md)

    def cos_sin_cache(self, max_positions: int, device: torch.device) -> torch.Tensor:
        """[max_positions, head_dim] fp32: the cos of the head_dim / 2 rotary frequencies, then their sin,
        from the model's own rotary module (its scaling included), for the fused rotary kernels."""
        pos = torch.arange(max_positions, device=device).unsqueeze(0)
        probe = torch.empty(1, 1, self.head_dim, dtype=torch.float32, device=device)
        cos, sin = self.rotary_emb(probe, pos)
        half = self.head_dim // 2
        return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float().contiguous()

    def _add_norm(self, ops: Ops, norm, h, delta, out_dtype=None):
        if self.plain_norms and ops.fused:
            return ops.add_rmsnorm(h, delta, norm, out_dtype)
        return _REFERENCE.add_rmsnorm(h, delta, norm, out_dtype)

    def _mlp(self, ops: Ops, li: int, layer, x: torch.Tensor) -> torch.Tensor:
        """`x`: the normed activations, in the model's dtype or already rounded to the matmul dtype."""
        gate_up, down = self.lin_gate_up[li], self.lin_down[li]
        if gate_up is None:
            return layer.mlp(x.to(self.dtype))
        if self.fuse_silu and ops.fused:
            if self.matmul_dtype == torch.bfloat16:  # bf16 product in, bf16 out: the rounding down's input gets anyway
                return down.product(ops.silu_mul(gate_up.product(x.to(torch.bfloat16)), None)).to(self.dtype)
            return down(ops.silu_mul(gate_up(x), None))
        return down(_REFERENCE.silu_mul(gate_up(x), layer.mlp.act_fn))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta, kv_cache: torch.Tensor, ops: Ops,
                cos_sin_cache: torch.Tensor | None = None, workspace=None):
        """The residual stream after the last layer and that layer's MLP output, not yet added (the final
        norm adds it, for the rows that need logits only). `meta`: the ops backend's step metadata."""
        T = ids.shape[0]
        h = self.embed_tokens(ids)
        rope = ops.rope_inputs(self.rotary_emb, h, positions, cos_sin_cache)
        delta = None  # the last sublayer's output, not yet added to the residual stream `h`
        for li, layer in enumerate(self.layers):
            h, x = self._add_norm(ops, layer.input_layernorm, h, delta, self.matmul_dtype)
            qkv = self.lin_qkv[li](x)
            k_cache, v_cache = kv_cache[:, li, 0], kv_cache[:, li, 1]
            q, k, v = ops.qkv_store(qkv, layer.self_attn, rope, k_cache, v_cache, meta, self.num_heads,
                                    self.num_kv_heads, self.head_dim)
            o = ops.attention(q, k, v, k_cache, v_cache, meta, self.scale, workspace, self.matmul_dtype)
            o = self.lin_o[li](o.reshape(T, -1))
            if self.tp is not None:  # row-parallel: each rank's heads' share of the projection
                self.tp.all_reduce(o)
            h, x = self._add_norm(ops, layer.post_attention_layernorm, h, o, self.matmul_dtype)
            delta = self._mlp(ops, li, layer, x)
            if self.tp is not None:
                self.tp.all_reduce(delta)
        return h, delta

    def logits(self, ops: Ops, h: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
        """fp32 logits of `rows`, on copies of them (`h` stays as it is); `rows` None: every row, and
        the residual stream `h` may be consumed (a fused norm adds into it in place). Under tensor
        parallelism every rank computes its vocab slice and rank 0 alone gets the logits (others: None)."""
        if rows is not None:
            h, delta = h[rows], delta[rows]
        _, x = self._add_norm(ops, self.norm, h, delta)
        if self.tp is None:
            return self.lin_head(x).float()
        full = self.tp.gather_last_dim(self.lin_head(x).float())
        return None if full is None else full[:, :self.vocab_size]
