"""Runs one scheduled step through a Llama-family model with a paged KV cache.

The weights and the layer modules are transformers' own (so any Llama / Mistral / Qwen2 / Qwen3
checkpoint transformers loads works); only the attention path and the batch layout are ours: tokens
of all requests are packed into one [T] batch without padding.
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.attention import (AttentionMetadata, KVWorkspace, PrefillSeq, attention_backends, decode_bucket,
                              paged_attention, paged_decode_meta, plan_decode_buckets, write_kv)
from engine import cpu_kernels
from engine.logprobs import token_logprobs
from engine.request import TokenLogprob
from engine.scheduler import SchedulerOutput
from engine.step_inputs import StepInputs


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache. On a CPU, the zeros come from an anonymous memory map, which the OS
    zero-fills a page at a time on first touch: `torch.zeros` writes every page at once, 4.7 s of one
    core for a 2 GB pool, which a worker starting next to busy ones (a replacement, a scale-up) takes
    from their cores while their clients wait. Zeros (not `torch.empty`'s leftovers) matter: the
    gather + SDPA path reads masked padding slots, and 0 x NaN would poison a row."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private anonymous memory: zero-filled by definition (Python's default, MAP_SHARED, is shared
    # memory). NOTE: huge pages (MADV_HUGEPAGE) were tried: 2 faults per batch-128 decode step over
    # a fresh pool instead of ~700, but the same system time (zeroing dominates), and no faster reads.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps `buf` alive (frombuffer holds a reference to the buffer's owner).
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here for `dtype` (bf16 needs a CPU oneDNN does bf16 on;
    elsewhere F.linear computes it)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """`y = x @ weight.T + bias`. On CPU the weight is reordered once into oneDNN's blocked layout.

    NOTE: F.linear repacks the weight on every call. Measured here (2 cores, fp32, SmolLM2's shapes,
    30 layers of weights that do not fit in cache): the prepacked path is 1.5x faster at 64 rows and
    2.2x at 8 (decode batches), ~1.15x at 1000 (prefill chunks). The cost is a second copy of the
    linear weights (the HF modules keep theirs: the model stays usable as a reference).

    `matmul_dtype` (bf16 on CPU): the weight is kept in it and `x` is rounded to it for the product,
    which comes back in `x`'s dtype (the CPU's bf16 path, see `ModelRunner`).
    """

    __slots__ = ("weight", "bias", "packed", "matmul_dtype", "out_dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool,
                 matmul_dtype: torch.dtype | None = None):
        self.out_dtype = weight.dtype  # what a call returns, whatever `x` comes in
        if matmul_dtype is not None and matmul_dtype != weight.dtype:
            weight = weight.detach().to(matmul_dtype)
            bias = None if bias is None else bias.detach().to(matmul_dtype)
        else:
            matmul_dtype = None
        self.weight, self.bias, self.matmul_dtype = weight, bias, matmul_dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if prepack else None
        if self.packed is not None and matmul_dtype is not None:
            self.weight = None  # the packed copy is all the product reads (the model keeps its own weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The product in the weight's own dtype (`x` in it, or already rounded to the matmul dtype)."""
        if self.matmul_dtype is not None:
            return self.product(x.to(self.matmul_dtype)).to(self.out_dtype)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The product for `x` already in the matmul dtype; the result is in it too."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


# transformers' RMSNorm classes that compute exactly `w * (x * rsqrt(mean(x^2) + eps))` (what
# `cpu_kernels.add_rmsnorm` computes); any other norm keeps its own module.
_PLAIN_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class _HostStep(NamedTuple):
    """One step's inputs as host lists, before they go to the device."""

    input_ids: list[int]
    positions: list[int]
    slot_blocks: list[int]  # the block each new token's K/V goes to
    sample_rows: list[int]  # packed rows whose logits are sampled
    decode_rows: list[int]
    decode_tables: list[list[int]]
    decode_lens: list[int]  # context length of each decode row, its new token included
    prefills: list[tuple[int, int, int, list[int]]]  # (start row, end row, tokens cached before, block table)
    prompt_spans: list[PromptSpan]  # rows whose logits score the next prompt token (prompt_logprobs)


class PromptSpan(NamedTuple):
    """Rows row0 .. row0 + len(target_ids) - 1 of a chunk of a request that asked for prompt_logprobs:
    each one's logits score the prompt token after it."""

    chunk_index: int
    row0: int
    target_ids: list[int]
    k: int


class StepLogits(NamedTuple):
    """What a step's forward pass returns."""

    logits: torch.Tensor  # fp32 [num sampled rows, vocab], in the order of `sched.chunks`
    # chunk index in `sched.chunks` -> logprobs of the prompt tokens at positions start + 1, start + 2, ...
    # of that chunk (start: the chunk's first position); only for requests that ask for prompt_logprobs.
    prompt_logprobs: dict[int, list[TokenLogprob]]


PROMPT_LOGITS_ROWS = 256  # prompt positions scored per lm_head call: bounds the [rows, vocab] logits in memory


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    def __init__(self, hf_model, num_blocks: int, block_size: int, device: str, kv_dtype: torch.dtype | None = None,
                 matmul_dtype: torch.dtype | None = None):
        """`matmul_dtype`: the dtype of the linear layers' products when it is not the model's (bf16 over
        an fp32 model on CPU: `LLMEngine`); everything else computes in the model's dtype."""
        self.hf_model = hf_model
        cfg = hf_model.config
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = next(hf_model.parameters()).dtype
        self.matmul_dtype = matmul_dtype if matmul_dtype != self.dtype else None
        self.kv_dtype = kv_dtype or self.dtype  # the cache's elements; the other math stays in self.dtype
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.block_size = block_size
        self.num_blocks = num_blocks
        # NOTE: the one KV tensor of this worker: [num_blocks, layers, 2, block_size, kv_heads, head_dim].
        # Block-major: a block holds its tokens' K and V of every layer, so a run of block ids is one
        # contiguous region, which kv_transfer sends in a few large messages straight from the cache
        # (layer-major, it took 2 x layers messages, and their per-message cost was a third of a
        # 512-token transfer). A layer's view `kv_cache[:, layer, k|v]` strides over whole blocks.
        self.kv_cache = zeroed_kv_cache(
            (num_blocks, self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim), self.kv_dtype, self.device)
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.scale = self.layers[0].self_attn.scaling
        self.workspace = KVWorkspace()  # gathered KV blocks land here, reused by every layer and step
        # Decode attention through the compiled CPU kernel (one read of the cache, no gather) when it
        # builds here; otherwise the gather + SDPA path. Tests switch it to compare the two.
        self.paged_decode = cpu_kernels.available(self.device, self.dtype, self.kv_dtype)
        if self.paged_decode:  # the attention specialised for this shape, compiled now, not at the first step
            cpu_kernels.prepare_decode(self.num_heads, self.num_kv_heads, self.head_dim)
        # The fused per-token ops (rotary + KV write, residual add + RMSNorm, SiLU x up), from the same
        # library, where the model's modules are the plain ones they replace. Tests switch it off to compare.
        self.fused_ops = self.paged_decode
        norms = [n for l in self.layers for n in (l.input_layernorm, l.post_attention_layernorm)] + [self.norm]
        self._fuse_norm = all(type(n).__name__ in _PLAIN_RMSNORMS and hasattr(n, "variance_epsilon") for n in norms)
        self._fuse_rope = not any(hasattr(l.self_attn, "q_norm") for l in self.layers)  # Qwen3 norms q/k first
        self._fuse_projections()
        self._fuse_silu = getattr(cfg, "hidden_act", None) == "silu" and all(gu is not None for gu in self._gate_up)
        self._build_linears(can_prepack(self.device, self.matmul_dtype or self.dtype))

    @torch.no_grad()
    def _fuse_projections(self) -> None:
        """One matmul for q/k/v and one for gate/up per layer: fewer, wider GEMMs (faster on CPU).

        NOTE: the HF modules' weights become views into the fused tensors, so memory does not grow and
        `hf_model` (the reference for tests) keeps computing with the very same values.
        """
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._gate_up: list[torch.Tensor] = []
        for layer in self.layers:
            a = layer.self_attn
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
            nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
            a.q_proj.weight.data, a.k_proj.weight.data, a.v_proj.weight.data = w[:nq], w[nq:nq + nk], w[nq + nk:]
            b = None
            if a.q_proj.bias is not None:
                b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).contiguous()
                a.q_proj.bias.data, a.k_proj.bias.data, a.v_proj.bias.data = b[:nq], b[nq:nq + nk], b[nq + nk:]
            self._qkv.append((w, b))
            m = layer.mlp
            fused = m.gate_proj.bias is None and m.up_proj.bias is None and hasattr(m, "act_fn")
            if fused:
                gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous()
                ni = m.gate_proj.weight.shape[0]
                m.gate_proj.weight.data, m.up_proj.weight.data = gu[:ni], gu[ni:]
                self._gate_up.append(gu)
            else:
                self._gate_up.append(None)

    @torch.no_grad()
    def _build_linears(self, prepack: bool) -> None:
        """The matmuls the forward pass runs: fused q/k/v, o, fused gate/up, down, and the lm_head."""
        md = self.matmul_dtype
        self._lin_qkv = [Linear(w, b, prepack, md) for w, b in self._qkv]
        self._lin_o = [Linear(l.self_attn.o_proj.weight, l.self_attn.o_proj.bias, prepack, md) for l in self.layers]
        self._lin_gate_up = [None if gu is None else Linear(gu, None, prepack, md) for gu in self._gate_up]
        self._lin_down = [None if gu is None else Linear(l.mlp.down_proj.weight, l.mlp.down_proj.bias, prepack, md)
                          for gu, l in zip(self._gate_up, self.layers)]
        self._lin_head = Linear(self.lm_head.weight, getattr(self.lm_head, "bias", None), prepack, md)

    def _mlp(self, li: int, layer, x: torch.Tensor) -> torch.Tensor:
        """`x`: the normed activations, in the model's dtype or already rounded to the matmul dtype."""
        gate_up = self._lin_gate_up[li]
        if gate_up is None:
            return layer.mlp(x.to(self.dtype))
        if self.fused_ops and self._fuse_silu:
            down = self._lin_down[li]
            if self.matmul_dtype == torch.bfloat16:  # bf16 product in, bf16 out: the rounding down's input gets anyway
                return down.product(cpu_kernels.silu_mul(gate_up.product(x.to(torch.bfloat16)))).to(self.dtype)
            return down(cpu_kernels.silu_mul(gate_up(x)))
        gate, up = gate_up(x).chunk(2, dim=-1)
        return self._lin_down[li](layer.mlp.act_fn(gate) * up)

    def _add_norm(self, norm, h: torch.Tensor, delta: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding `delta` (a layer's output; None: nothing to add), and its
        norm, in `out_dtype` when given (bf16: the input of the next matmul, rounded here once rather
        than in a copy). The fused path adds in place: `h` is the runner's own activation, never a caller's."""
        if self.fused_ops and self._fuse_norm:
            return h, cpu_kernels.add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, out_dtype or h.dtype)
        if delta is not None:
            h = h + delta
        x = norm(h)
        return h, x if out_dtype is None else x.to(out_dtype)

    @staticmethod
    def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_hidden_layers * 2 * block_size * kv_heads * head_dim * elem

    # ------------------------------------------------------------------ inputs
    def _host_inputs(self, sched: SchedulerOutput) -> _HostStep:
        """The step's inputs as Python lists (no tensors yet)."""
        bs = self.block_size
        # NOTE: plain local lists in the loop (a NamedTuple's fields cost an attribute lookup each).
        input_ids, positions, slot_blocks, sample_rows = [], [], [], []
        decode_rows, decode_tables, decode_lens, prefills, spans = [], [], [], [], []
        for ci, chunk in enumerate(sched.chunks):
            req = chunk.request
            start = req.num_computed_tokens
            n = chunk.num_new_tokens
            end = start + n
            row0 = len(input_ids)
            if chunk.num_spec:  # the last committed token, then the drafts
                input_ids.append(req.all_token_ids[start])
                input_ids.extend(req.spec_token_ids[:chunk.num_spec])
            else:
                input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = req.block_table
            slot_blocks.extend(table[p // bs] for p in range(start, end))
            if n == 1 or chunk.num_spec:
                # NOTE: a chunk with drafts attends as 1 + k decode rows over the same blocks, row j
                # seeing the context up to its own position (start + j): the causal mask inside the
                # span, and each row computed exactly as decoding that token alone would compute it
                # (the step writes every new token's K/V before any attention reads the cache).
                decode_rows.extend(range(row0, row0 + n))
                decode_tables.extend([table] * n)
                decode_lens.extend(range(start + 1, end + 1))
            else:
                prefills.append((row0, row0 + n, start, table[: -(-end // bs)]))
            if chunk.num_spec:
                sample_rows.extend(range(row0, row0 + n))
            elif chunk.samples:
                sample_rows.append(len(input_ids) - 1)
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and not chunk.num_spec:
                targets = req.prompt_token_ids[start + 1:min(end, req.num_prompt_tokens - 1) + 1]
                if targets:
                    spans.append(PromptSpan(ci, row0, targets, req.params.prompt_logprobs))
        return _HostStep(input_ids, positions, slot_blocks, sample_rows, decode_rows, decode_tables, decode_lens,
                         prefills, spans)

    def _prepare(self, sched: SchedulerOutput):
        """The step's device inputs: token ids, positions, attention metadata, rows to sample.

        NOTE: every integer array goes to the device in one non-blocking copy (`StepInputs`): no
        per-step host-device synchronization before the forward pass."""
        hs = self._host_inputs(sched)
        bs, dev = self.block_size, self.device
        inputs = StepInputs()
        k_ids, k_pos, k_slots, k_sample = (inputs.add(a) for a in (hs.input_ids, hs.positions, hs.slot_blocks,
                                                                   hs.sample_rows))
        k_tables = [inputs.add(table) for *_, table in hs.prefills]
        paged, plans = None, []
        if hs.decode_rows and self.paged_decode:  # the CPU kernel's own int32 metadata
            paged = paged_decode_meta(hs.decode_rows, hs.decode_tables, hs.decode_lens, bs)
        elif hs.decode_rows:
            plans = plan_decode_buckets(hs.decode_rows, hs.decode_tables, hs.decode_lens, bs)
        k_buckets = [(inputs.add(p.rows), inputs.add(p.blocks), None if p.lens is None else inputs.add(p.lens))
                     for p in plans]
        t = inputs.upload(dev)
        pos = t[k_pos]
        meta = AttentionMetadata(
            slot_blocks=t[k_slots],
            slot_offsets=pos % bs,
            decode=[decode_bucket(p, t[r], t[b], None if n is None else t[n], bs)
                    for p, (r, b, n) in zip(plans, k_buckets)],
            prefills=[PrefillSeq(r0, r1, start, t[k]) for (r0, r1, start, _), k in zip(hs.prefills, k_tables)],
            paged=paged,
        )
        return t[k_ids], pos, meta, t[k_sample], hs.prompt_spans

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepLogits:
        """Returns fp32 logits [num_sampled_rows, vocab], in the order of `sched.chunks`: one row per
        sampling chunk, 1 + num_spec rows (one per position) for a chunk with drafts; and the prompt
        logprobs of the chunks whose request asks for them (only those pay for logits at prompt rows).

        NOTE: reads the scheduled requests and the KV cache only; it must never call the block manager
        (a worker runs block-manager calls from other threads while this runs: `LLMEngine.step`)."""
        with attention_backends(self.device):
            return self._forward(sched)

    def _forward(self, sched: SchedulerOutput) -> StepLogits:
        ids, pos, meta, sample_rows, spans = self._prepare(sched)
        num_tokens = ids.shape[0]
        h = self.embed_tokens(ids)
        cos, sin = self.rotary_emb(h.unsqueeze(0), pos.unsqueeze(0))
        fuse_rope = self.fused_ops and self._fuse_rope and cos.shape[-1] == self.head_dim
        cos2, sin2 = cos[0].contiguous(), sin[0].contiguous()  # [T, head_dim]
        cos, sin = cos2.unsqueeze(1), sin2.unsqueeze(1)  # [T, 1, head_dim]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        delta = None  # the last sublayer's output, not yet added to the residual stream `h`
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h, x = self._add_norm(layer.input_layernorm, h, delta, self.matmul_dtype)
            qkv = self._lin_qkv[li](x)
            k_cache, v_cache = self.kv_cache[:, li, 0], self.kv_cache[:, li, 1]
            if fuse_rope:
                q = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
                cpu_kernels.rope_store(qkv, q, cos2, sin2, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets,
                                       self.num_heads)
                k = qkv[:, nq:nq + nkv].view(num_tokens, self.num_kv_heads, self.head_dim)
                v = qkv[:, nq + nkv:].view(num_tokens, self.num_kv_heads, self.head_dim)
            else:
                q = qkv[:, :nq].view(num_tokens, self.num_heads, self.head_dim)
                k = qkv[:, nq:nq + nkv].reshape(num_tokens, self.num_kv_heads, self.head_dim)
                v = qkv[:, nq + nkv:].reshape(num_tokens, self.num_kv_heads, self.head_dim)
                if hasattr(attn, "q_norm"):  # Qwen3
                    q = attn.q_norm(q)
                    k = attn.k_norm(k)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                write_kv(k_cache, v_cache, k, v, meta)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.workspace, self.matmul_dtype)
            h, x = self._add_norm(layer.post_attention_layernorm, h, self._lin_o[li](o.reshape(num_tokens, -1)),
                                  self.matmul_dtype)
            delta = self._mlp(li, layer, x)
        prompt = {span.chunk_index: self._prompt_logprobs(h, delta, span) for span in spans}
        if sample_rows.numel() == 0:
            return StepLogits(torch.empty(0, self.config.vocab_size, device=self.device), prompt)
        _, h = self._add_norm(self.norm, h[sample_rows], delta[sample_rows])
        return StepLogits(self._lin_head(h).float(), prompt)

    def _prompt_logprobs(self, h: torch.Tensor, delta: torch.Tensor, span: PromptSpan) -> list[TokenLogprob]:
        """The logprobs of `span`'s target tokens from the final hidden states at its rows, a slice of rows
        at a time (the norm works on a copy of the rows: `h` stays as it is for the sampled rows)."""
        out: list[TokenLogprob] = []
        for a in range(0, len(span.target_ids), PROMPT_LOGITS_ROWS):
            b = min(a + PROMPT_LOGITS_ROWS, len(span.target_ids))
            rows = torch.arange(span.row0 + a, span.row0 + b, device=h.device)
            _, x = self._add_norm(self.norm, h[rows], delta[rows])
            out.extend(token_logprobs(self._lin_head(x).float(), span.target_ids[a:b], span.k))
        return out
