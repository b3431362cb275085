"""Runs one scheduled step: prepares its inputs, runs the model (engine/models) eagerly or by replaying a
CUDA graph (engine/cuda_graphs.py), and returns the logits the sampler draws from.

Tokens of all requests are packed into one [T] batch without padding; the per-token ops come from the
ops backend (engine/ops) chosen for the device: Triton on CUDA, our C kernels on a CPU, the torch
reference elsewhere.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from typing import NamedTuple

import torch

from engine import cpu_kernels
from engine.attention import KVWorkspace, attention_backends
from engine.logprobs import token_logprobs
from engine.models import LlamaModel
from engine.ops import make_ops
from engine.ops.base import HostStep, PromptSpan
from engine.ops.cpu_ops import CpuOps
from engine.models.sharding import local_kv_heads
from engine.parallel.group import TPGroup
from engine.parallel.messages import ShutdownMessage, StepMessage
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


class StepLogits(NamedTuple):
    """What a step's forward pass returns."""

    logits: torch.Tensor  # fp32 [num sampled rows, vocab], in the order of `sched.chunks`
    # chunk index in `sched.chunks` -> logprobs of the prompt tokens at positions start + 1, start + 2, ...
    # of that chunk (start: the chunk's first position); only for requests that ask for prompt_logprobs.
    prompt_logprobs: dict[int, list[TokenLogprob]]


PROMPT_LOGITS_ROWS = 256  # prompt positions scored per lm_head call: bounds the [rows, vocab] logits in memory



class ModelRunner:
    def __init__(self, hf_model, num_blocks: int, block_size: int, device: str, kv_dtype: torch.dtype | None = None,
                 matmul_dtype: torch.dtype | None = None, ops_backend: str = "auto", cuda_graphs: bool = True,
                 max_num_seqs: int = 64, max_model_len: int | None = None, num_speculative_tokens: int = 0,
                 tp: TPGroup | None = None, weights=None):
        """`matmul_dtype`: the dtype of the linear layers' products when it is not the model's (bf16 over
        an fp32 model on CPU: `LLMEngine`). `cuda_graphs`: replay decode and verify steps from CUDA
        graphs (CUDA with the Triton backend only; mixed steps always run eagerly; not under tensor
        parallelism). `tp`: this rank's group (engine.parallel); rank 0's runner hands every step's
        host inputs to the other ranks, which run `run_eager` on them (`engine.parallel.worker`);
        `weights`: where its slices come from (`LlamaModel`)."""
        self.hf_model = hf_model
        self.config = hf_model.config
        self.device = torch.device(device)
        self.tp = tp or TPGroup.single()
        self.model = LlamaModel(hf_model, self.device, matmul_dtype, self.tp, weights)
        m = self.model
        self.dtype, self.matmul_dtype = m.dtype, m.matmul_dtype
        self.kv_dtype = kv_dtype or self.dtype  # the cache's elements; the other math stays in self.dtype
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = (m.num_layers, m.num_heads,
                                                                            m.num_kv_heads, m.head_dim)
        self.scale = m.scale
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings, num_blocks * block_size)
        # NOTE: the one KV tensor of this worker: [num_blocks, layers, 2, block_size, kv_heads, head_dim].
        # Block-major: a block holds its tokens' K and V of every layer, so a run of block ids is one
        # contiguous region, which kv_transfer sends in a few large messages straight from the cache.
        # A layer's view `kv_cache[:, layer, k|v]` strides over whole blocks.
        self.kv_cache = zeroed_kv_cache(
            (num_blocks, self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim), self.kv_dtype, self.device)
        # CUDA: the stream every step runs on, handed to the KV transport explicitly (transfers order
        # against it by events); None on a CPU.
        self.compute_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.workspace = KVWorkspace()  # gathered KV blocks land here (torch/cpu backends' prefill and buckets)
        self.ops = make_ops(ops_backend, self.device, self.dtype, self.kv_dtype)
        if self.ops.name == "cpu":  # the attention specialised for this shape, compiled now, not at the first step
            cpu_kernels.prepare_decode(self.num_heads, self.num_kv_heads, self.head_dim)
        self.cos_sin = None
        if self.ops.name == "triton":
            self.cos_sin = m.cos_sin_cache(self.max_model_len, self.device)
        self.graphs = None
        if cuda_graphs and self.ops.name == "triton" and self.tp.world == 1:  # off CUDA (interpreter, tests): the padded path, eager
            from engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, max_num_seqs, 1 + num_speculative_tokens)

    # The CPU backend's two kernel families, switched off one at a time by tests and benchmarks.
    @property
    def paged_decode(self) -> bool:
        return bool(getattr(self.ops, "paged_decode", False))

    @paged_decode.setter
    def paged_decode(self, on: bool) -> None:
        self._switch("paged_decode", on)

    @property
    def fused_ops(self) -> bool:
        return self.ops.fused

    @fused_ops.setter
    def fused_ops(self, on: bool) -> None:
        self._switch("fused", on)

    def _switch(self, attr: str, on: bool) -> None:
        """Set one of the cpu backend's kernel switches; elsewhere only its current value is accepted
        (nothing is accepted and ignored)."""
        if isinstance(self.ops, CpuOps):
            setattr(self.ops, attr, on)
        elif bool(getattr(self.ops, attr, False)) != on:
            raise ValueError(f"{attr} is a switch of the cpu ops backend; this runner has {self.ops.name!r}")

    @staticmethod
    def kv_block_bytes(config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes of one KV block on one rank (of `tp_size`: its KV heads only)."""
        heads = config.num_attention_heads
        kv_heads = local_kv_heads(config, tp_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_hidden_layers * 2 * block_size * kv_heads * head_dim * elem

    # ------------------------------------------------------------------ inputs
    def host_inputs(self, sched: SchedulerOutput) -> HostStep:
        """The step's inputs as Python lists (no tensors yet)."""
        bs = self.block_size
        # NOTE: plain local lists in the loop (a NamedTuple's fields cost an attribute lookup each).
        input_ids, positions, slot_blocks, sample_rows = [], [], [], []
        decode_rows, decode_tables, decode_lens, prefills, spans = [], [], [], [], []
        seq_qlens, seq_lens, seq_tables = [], [], []
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
            seq_qlens.append(n)
            seq_lens.append(end)
            seq_tables.append(table)
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
        return HostStep(input_ids, positions, slot_blocks, sample_rows, decode_rows, decode_tables, decode_lens,
                        prefills, spans, seq_qlens, seq_lens, seq_tables)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepLogits:
        """Returns fp32 logits [num_sampled_rows, vocab], in the order of `sched.chunks`: one row per
        sampling chunk, 1 + num_spec rows (one per position) for a chunk with drafts; and the prompt
        logprobs of the chunks whose request asks for them (only those pay for logits at prompt rows).

        NOTE: reads the scheduled requests and the KV cache only; it must never call the block manager
        (a worker runs block-manager calls from other threads while this runs: `LLMEngine.step`)."""
        with torch.cuda.stream(self.compute_stream) if self.compute_stream is not None else contextlib.nullcontext():
            return self._run(sched)

    def _run(self, sched: SchedulerOutput) -> StepLogits:
        hs = self.host_inputs(sched)
        if self.graphs is not None:
            logits = self.graphs.try_run(hs)
            if logits is not None:
                return StepLogits(logits, {})
        if self.tp.world > 1:
            with self.tp.lock:  # NOTE: the step message and its collectives, not interleaved with a KV gather
                self.tp.send(StepMessage(hs))
                with attention_backends(self.device):
                    return self.run_eager(hs)
        with attention_backends(self.device):
            return self.run_eager(hs)

    def run_eager(self, hs: HostStep) -> StepLogits:
        """The step without CUDA graphs. NOTE: every integer array goes to the device in one
        non-blocking copy (`StepInputs`): no host-device synchronization before the forward pass.
        Every rank of a TP group runs it on the same `hs` (same collectives, same order); the logits
        land on rank 0 (a follower's StepLogits holds None and no prompt logprobs)."""
        inputs = StepInputs()
        k_ids, k_pos, k_sample = inputs.add(hs.input_ids), inputs.add(hs.positions), inputs.add(hs.sample_rows)
        build = self.ops.plan(hs, inputs, self.block_size)
        t = inputs.upload(self.device)
        m = self.model
        h, delta = m.forward(t[k_ids], t[k_pos], build(t), self.kv_cache, self.ops, self.cos_sin, self.workspace)
        prompt = {span.chunk_index: self._prompt_logprobs(h, delta, span) for span in hs.prompt_spans}
        if not hs.sample_rows:
            return StepLogits(torch.empty(0, self.config.vocab_size, device=self.device), prompt)
        return StepLogits(m.logits(self.ops, h, delta, t[k_sample]), prompt)

    def close(self) -> None:
        """Rank 0 of a TP group: tell the followers to stop, and leave the group (idempotent)."""
        if self.tp.world > 1 and self.tp.rank == 0 and not self.tp.closed:
            held = self.tp.lock.acquire(timeout=30.0)  # a KV gather under way ends first (or its peer died)
            try:
                self.tp.send(ShutdownMessage(), is_step=False)
            finally:
                self.tp.close()
                if held:
                    self.tp.lock.release()

    def _prompt_logprobs(self, h: torch.Tensor, delta: torch.Tensor, span: PromptSpan) -> list[TokenLogprob]:
        """The logprobs of `span`'s target tokens from the final hidden states at its rows, a slice of rows
        at a time (the norm works on a copy of the rows: `h` stays as it is for the sampled rows)."""
        out: list[TokenLogprob] = []
        for a in range(0, len(span.target_ids), PROMPT_LOGITS_ROWS):
            b = min(a + PROMPT_LOGITS_ROWS, len(span.target_ids))
            rows = torch.arange(span.row0 + a, span.row0 + b, device=h.device)
            logits = self.model.logits(self.ops, h, delta, rows)
            if logits is not None:  # None: a TP follower, which only lends its vocab slice
                out.extend(token_logprobs(logits, span.target_ids[a:b], span.k))
        return out
