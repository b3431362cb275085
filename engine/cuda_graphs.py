"""Decode and speculative-verify steps replayed from CUDA graphs.

A graph is captured per (padded batch B, query rows per sequence Q): Q = 1 for decode steps, Q = 1 + k
for steps that verify up to k drafts per sequence. B runs over a ladder (1, 2, 4, then steps of 8 up to
`max_num_seqs`); a step of n sequences replays the smallest B >= n. All graphs share one memory pool,
and are captured on first use (the first step at a size pays ~the capture).

Inputs travel as ONE int64 array: the host fills a pinned staging buffer, one non-blocking copy moves
it into the device buffer the graph reads, and the graph itself converts the int32 sections.

    staging (B, Q):  ids[B*Q] | positions[B*Q] | slot_mapping[B*Q] | seq_lens[B] | query_start[B+1] | tables[B*W]

Off CUDA (the Triton backend under TRITON_INTERPRET=1, in tests) nothing is captured: each "replay"
runs the same padded forward eagerly over the same static buffers, so the CPU suite checks the
padding, the staging layout and the ladder end to end.

NOTE: padding rows and sequences write nothing: their slot is -1 (the KV store skips it) and their
sequences have no query rows (attention skips them); the rows' other outputs are computed and ignored.
Mixed steps (a prefill chunk, prompt logprobs) always run eagerly.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from engine.ops.base import HostStep
from engine.ops.triton_ops import TritonMeta


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes graphs are captured at: 1, 2, 4, then multiples of 8, up to the first size
    that holds `max_num_seqs`."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 8 else sizes[-1] + 8)
    return sizes


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest size in `sizes` (ascending) that holds n sequences; None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class StagingLayout:
    """Offsets of each section of the int64 staging array for a graph of B sequences, Q rows each."""

    def __init__(self, batch: int, query_len: int, width: int):
        t = batch * query_len
        self.batch, self.query_len, self.width, self.num_rows = batch, query_len, width, t
        self.ids, self.pos, self.slots = 0, t, 2 * t
        self.lens = 3 * t
        self.qsl = self.lens + batch
        self.tables = self.qsl + batch + 1
        self.size = self.tables + batch * width

    def fill(self, buf, hs: HostStep, block_size: int) -> None:
        """Write `hs` (n <= batch sequences, at most query_len rows each) into `buf` (a numpy int64 view),
        padding the rest. Stale table entries past a sequence's length are never read."""
        n_rows, n_seqs = len(hs.input_ids), len(hs.seq_lens)
        t = self.num_rows
        buf[self.ids:self.ids + n_rows] = hs.input_ids
        buf[self.ids + n_rows:self.ids + t] = 0
        buf[self.pos:self.pos + n_rows] = hs.positions
        buf[self.pos + n_rows:self.pos + t] = 0
        buf[self.slots:self.slots + n_rows] = [b * block_size + p % block_size
                                               for b, p in zip(hs.slot_blocks, hs.positions)]
        buf[self.slots + n_rows:self.slots + t] = -1
        buf[self.lens:self.lens + n_seqs] = hs.seq_lens
        buf[self.lens + n_seqs:self.lens + self.batch] = 0
        q = self.qsl
        buf[q] = 0
        buf[q + 1:q + 1 + n_seqs] = list(itertools.accumulate(hs.seq_query_lens))
        buf[q + 1 + n_seqs:q + 1 + self.batch] = n_rows
        w = self.width
        for i, (table, ln) in enumerate(zip(hs.seq_tables, hs.seq_lens)):
            used = -(-ln // block_size)
            o = self.tables + i * w
            buf[o:o + used] = table[:used]


class DecodeGraphs:
    """Captures and replays the forward pass (and the logits of every row) of decode / verify steps."""

    def __init__(self, runner, max_num_seqs: int, max_query_len: int):
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        self.query_lens = sorted({1, max_query_len})
        self.width = -(-runner.max_model_len // runner.block_size)
        biggest = StagingLayout(self.sizes[-1], self.query_lens[-1], self.width).size
        dev = runner.device
        self.capture = dev.type == "cuda"
        self.device_buf = torch.zeros(biggest, dtype=torch.int64, device=dev)
        # NOTE: two pinned host buffers, used in turn: a step's copy may still be reading one while
        # the host fills the other (each step also ends with the sampler's read, which orders them).
        self.host_bufs = [torch.zeros(biggest, dtype=torch.int64, pin_memory=self.capture) for _ in range(2)]
        self.turn = 0
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor | None, StagingLayout]] = {}
        self.num_replays = 0

    def key(self, hs: HostStep) -> tuple[int, int] | None:
        """(B, Q) of the graph that runs `hs`, or None when the step must run eagerly."""
        if hs.prefills or hs.prompt_spans or not hs.seq_lens or len(hs.sample_rows) != len(hs.input_ids):
            return None
        q = max(hs.seq_query_lens)
        qi = bisect.bisect_left(self.query_lens, q)
        b = padded_size(len(hs.seq_lens), self.sizes)
        if qi == len(self.query_lens) or b is None:
            return None
        if max(hs.seq_lens) > self.runner.max_model_len:
            return None
        return b, self.query_lens[qi]

    def try_run(self, hs: HostStep) -> torch.Tensor | None:
        """The fp32 logits of every row of `hs` from a graph replay, or None (run it eagerly)."""
        key = self.key(hs)
        if key is None:
            return None
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, out, layout = self.graphs[key]
        host = self.host_bufs[self.turn]
        self.turn ^= 1
        layout.fill(host.numpy(), hs, self.runner.block_size)
        self.device_buf[:layout.size].copy_(host[:layout.size], non_blocking=True)
        if graph is None:  # no CUDA: the same padded forward, eagerly
            out = self._body(layout)
        else:
            graph.replay()
        self.num_replays += 1
        return out[:len(hs.input_ids)]

    def _body(self, layout: StagingLayout) -> torch.Tensor:
        r, d, L = self.runner, self.device_buf, layout
        t = L.num_rows
        meta = TritonMeta(
            slot_mapping=d[L.slots:L.slots + t],
            block_tables=d[L.tables:L.tables + L.batch * L.width].view(L.batch, L.width).to(torch.int32),
            seq_lens=d[L.lens:L.lens + L.batch].to(torch.int32),
            query_start_loc=d[L.qsl:L.qsl + L.batch + 1].to(torch.int32),
            max_query_len=L.query_len)
        h, delta = r.model.forward(d[L.ids:L.ids + t], d[L.pos:L.pos + t], meta, r.kv_cache, r.ops, r.cos_sin)
        return r.model.logits(r.ops, h, delta, None)

    def _capture(self, batch: int, query_len: int):
        layout = StagingLayout(batch, query_len, self.width)
        if not self.capture:
            return None, None, layout
        d = self.device_buf
        # All-padding inputs while capturing: no sequence has rows and every slot is -1, so the warm-up
        # and the capture write nothing to the KV cache.
        d.zero_()
        d[layout.slots:layout.slots + layout.num_rows] = -1
        side = torch.cuda.Stream(device=d.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels and settles the allocator before capture
            self._body(layout)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._body(layout)
        return graph, out, layout
