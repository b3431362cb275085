"""The GPU engine's Triton kernels against plain torch references (HF Llama's formulas, written out here).

Without CUDA the kernels run in Triton's interpreter on the CPU (tiny shapes: it is slow); with CUDA
the same tests run compiled on the GPU, and `TestOnGPU` adds real shapes.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    # NOTE: read when a kernel is decorated (at its module's import), so it must be set first.
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import engine.triton_kernels as tk  # noqa: E402
from engine.triton_kernels import attention as tka, fused_ops as tko  # noqa: E402

if not _CUDA and not tko.interpreted(tko._silu_mul_kernel):  # imported earlier in this process, compiled
    tko = importlib.reload(tko)
    tka = importlib.reload(tka)

DEV = "cuda" if _CUDA else "cpu"
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between two same-dtype 16-bit float tensors."""
    def key(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return int((key(a) - key(b)).abs().max()) if a.numel() else 0


def assert_close_dtype(got: torch.Tensor, want: torch.Tensor, max_ulp: int = 1) -> None:
    """fp32: within a few fp32 ulps. 16-bit: within `max_ulp` and equal almost everywhere (a rounding
    step left out moves a quarter of the elements by 1 ulp: the count catches what the bound cannot)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        assert ulp_diff(got, want) <= max_ulp
        assert (got != want).float().mean() <= 0.005, f"{int((got != want).sum())} of {got.numel()} differ"


# ---------------------------------------------------------------------------------------------- attention
def make_batch(specs, num_heads, num_kv_heads, head_dim, kv_dtype, q_dtype, block_size=8, pad_rows=3, seed=0):
    """Sequences (q_len, tokens cached before) over a shuffled pool of blocks, K/V stored in layer 1 of
    a 2-layer block-major cache whose unused slots hold NaN. Returns the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(q + c) // block_size) for q, c in specs]
    num_blocks = sum(need) + 5
    cache = torch.full((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), float("nan")).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 2
    tables = torch.tensor(perm[:width], dtype=torch.int32).repeat(len(specs), 1)  # unused entries: real blocks
    used, blocks, offsets = 0, [], []
    for s, (n, (q, c)) in enumerate(zip(need, specs)):
        tables[s, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
        pos = torch.arange(q + c)
        blocks.append(tables[s].long()[pos // block_size])
        offsets.append(pos % block_size)
    blocks, offsets = torch.cat(blocks), torch.cat(offsets)
    as_bytes = cache.view(torch.uint8) if kv_dtype == torch.float8_e5m2 else cache  # CPU indexing lacks fp8
    for which in (0, 1):
        kv = torch.randn(blocks.numel(), num_kv_heads, head_dim, generator=g).to(kv_dtype)
        as_bytes[:, 1, which][blocks, offsets] = kv.view(as_bytes.dtype)
    qsl = torch.tensor([0] + [q for q, _ in specs], dtype=torch.int32).cumsum(0).to(torch.int32)
    T = int(qsl[-1]) + pad_rows
    q = torch.randn(T, num_heads, head_dim, generator=g).to(q_dtype)
    seq_lens = torch.tensor([q + c for q, c in specs], dtype=torch.int32)
    d = torch.device(DEV)
    return dict(q=q.to(d), k_cache=cache.to(d)[:, 1, 0], v_cache=cache.to(d)[:, 1, 1], block_tables=tables.to(d),
                seq_lens=seq_lens.to(d), query_start_loc=qsl.to(d), max_query_len=max(q for q, _ in specs),
                scale=head_dim ** -0.5)


def reference_attention(a: dict) -> torch.Tensor:
    """fp64, one sequence at a time; K/V rounded to q's dtype first (as the engine's torch path does)."""
    q, kc, vc = a["q"].cpu(), a["k_cache"].cpu(), a["v_cache"].cpu()
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    bs, group = kc.shape[1], q.shape[1] // kc.shape[2]
    qsl, lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
    for s, L in enumerate(lens):
        r0, r1 = qsl[s], qsl[s + 1]
        if r1 == r0:
            continue
        blocks = a["block_tables"][s, :-(-L // bs)].cpu().long()
        k = kc[blocks].flatten(0, 1)[:L].to(q.dtype).double().repeat_interleave(group, dim=1)
        v = vc[blocks].flatten(0, 1)[:L].to(q.dtype).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[r0:r1].double(), k) * a["scale"]
        pos = torch.arange(L - (r1 - r0), L).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(L).unsqueeze(0) > pos, float("-inf"))
        out[r0:r1] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out


def run_attention(a: dict) -> torch.Tensor:
    out = torch.full_like(a["q"], float("nan"))  # padding rows must stay NaN
    tka.unified_attention(out=out, **a)
    return out.cpu()


def check_attention(a: dict) -> None:
    got, want = run_attention(a), reference_attention(a)
    real = int(a["query_start_loc"][-1])
    assert got[real:].isnan().all(), "rows past the last sequence were written"
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[got.dtype]
    torch.testing.assert_close(got[:real].double(), want[:real], rtol=tol, atol=tol)


MIXED = [(9, 0), (7, 13), (1, 20), (0, 0), (1, 37), (4, 17), (1, 2), (0, 0)]  # (q_len, cached before)
KV_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
            (torch.float8_e5m2, torch.bfloat16)]  # (cache, q)


@pytest.fixture(autouse=True)
def _few_splits(monkeypatch):
    """The interpreter runs programs one at a time: split K/V into a few shares (a mixed batch of
    group 1 splits too: its rows fit one query tile), not into up to 16 of them."""
    if not _CUDA:
        monkeypatch.setattr(tka, "TARGET_PROGRAMS", 32)


@pytest.fixture(params=["default", "small"])
def tiles(request, monkeypatch):
    """The default tiles, or small ones that cut queries and contexts into several tiles each."""
    if request.param == "small":
        monkeypatch.setattr(tka, "BLOCK_N", 16)
        monkeypatch.setattr(tka, "PREFILL_BLOCK_M", 16)
    return request.param


small_tiles = pytest.mark.parametrize("tiles", ["small"], indirect=True)
default_tiles = pytest.mark.parametrize("tiles", ["default"], indirect=True)
GROUPS = {"g1": (2, 2), "g3": (6, 2), "g8": (8, 1)}  # (heads, kv_heads)


@small_tiles
@pytest.mark.parametrize("kv_dtype,q_dtype", KV_CASES, ids=lambda x: str(x).split(".")[-1])
@pytest.mark.parametrize("group", list(GROUPS))
def test_attention_mixed_batch(kv_dtype, q_dtype, group, tiles):
    """Prefill from scratch, chunked prefill, decode, speculative rows and padding, in one launch."""
    check_attention(make_batch(MIXED, *GROUPS[group], 16, kv_dtype, q_dtype))


@default_tiles
@pytest.mark.parametrize("group,kv_dtype,q_dtype", [("g1", torch.float32, torch.float32),
                                                    ("g3", torch.bfloat16, torch.bfloat16),
                                                    ("g8", torch.float8_e5m2, torch.float16)])
def test_attention_mixed_batch_default_tiles(group, kv_dtype, q_dtype, tiles):
    check_attention(make_batch(MIXED, *GROUPS[group], 32, kv_dtype, q_dtype, block_size=16))


@pytest.mark.parametrize("max_splits", [4, 1], ids=["split", "whole"])
@pytest.mark.parametrize("specs", [[(1, 5), (1, 40), (1, 16), (0, 0)], [(4, 3), (3, 29), (2, 0)]],
                         ids=["decode", "verify"])
@small_tiles
def test_attention_decode_and_verify_batches(specs, max_splits, tiles, monkeypatch):
    """Few sequences of decode/verify rows: split K/V (shares of a 16-token tile, some empty) or not."""
    monkeypatch.setattr(tka, "MAX_SPLITS", max_splits)
    monkeypatch.setattr(tka, "TARGET_PROGRAMS", 32)  # on a GPU too
    a = make_batch(specs, 6, 2, 32, torch.bfloat16, torch.bfloat16, block_size=16)
    block_q = tka.tile_config(6, 2, a["max_query_len"])[1]
    assert tka.split_count(len(specs), 2, a["max_query_len"], block_q) == max_splits
    check_attention(a)


def test_attention_head_dim_must_be_power_of_two():
    a = make_batch([(1, 3)], 2, 2, 16, torch.float32, torch.float32)
    a["q"] = torch.zeros(a["q"].shape[0], 2, 24, device=DEV)
    a["k_cache"] = a["v_cache"] = torch.zeros(4, 8, 2, 24, device=DEV)
    with pytest.raises(AssertionError, match="power of two"):
        run_attention(a)


def test_attention_matches_engine_paged_attention():
    """The engine's torch path (SDPA over gathered blocks) on the same packed batch."""
    from engine.attention import AttentionMetadata, PrefillSeq, decode_buckets, paged_attention

    specs = [(6, 0), (5, 11), (1, 9), (1, 30)]
    a = make_batch(specs, 4, 2, 16, torch.float32, torch.float32, pad_rows=0)
    for c in (a["k_cache"], a["v_cache"]):  # the engine's cache starts zeroed (its SDPA reads masked slots)
        c.nan_to_num_(0.0)
    qsl, bs = a["query_start_loc"].tolist(), a["k_cache"].shape[1]
    tables = [t.tolist() for t in a["block_tables"].cpu()]
    kc, vc = a["k_cache"].cpu(), a["v_cache"].cpu()
    k = kc[torch.tensor(tables[0])].flatten(0, 1)[:6]  # the first chunk's new K/V (it has no context)
    v = vc[torch.tensor(tables[0])].flatten(0, 1)[:6]
    pad = torch.zeros(qsl[-1] - 6, *k.shape[1:])
    meta = AttentionMetadata(
        slot_blocks=torch.zeros(0), slot_offsets=torch.zeros(0),
        decode=decode_buckets([qsl[2], qsl[3]], tables[2:], [10, 31], bs, torch.device("cpu")),
        prefills=[PrefillSeq(0, 6, 0, torch.tensor(tables[0][:1])),
                  PrefillSeq(qsl[1], qsl[2], 11, torch.tensor(tables[1][:2]))])
    want = paged_attention(a["q"].cpu(), torch.cat([k, pad]), torch.cat([v, pad]), kc, vc, meta, a["scale"])
    torch.testing.assert_close(run_attention(a), want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------- fused ops
def hf_rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q, k (cos/sin already in x's dtype)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def check_add_rmsnorm(dtype: torch.dtype, with_delta: bool, T: int, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(T, n, generator=g) * 3).to(dtype)
    delta = torch.randn(T, n, generator=g).to(dtype) if with_delta else None
    weight = (1 + torch.randn(n, generator=g) / 4).to(dtype)
    want_h = h + delta if with_delta else h.clone()
    want = hf_rmsnorm(want_h, weight, 1e-5)
    hd = h.to(DEV)
    out = torch.empty(T, n, dtype=dtype, device=DEV)
    got = tko.add_rmsnorm(hd, None if delta is None else delta.to(DEV), weight.to(DEV), 1e-5, out=out)
    assert got is out
    assert torch.equal(hd.cpu(), want_h), "the residual stream must be h + delta, in place, rounded to h's dtype"
    assert_close_dtype(got.cpu(), want)


def check_silu_mul(dtype: torch.dtype, T: int, n: int) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(T, 2 * n, generator=g) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up  # HF's LlamaMLP: act_fn(gate) * up, in the model's dtype
    # exp may differ from torch's by an fp32 ulp: silu by 1 ulp of the dtype, rarely, the product by up to 2
    assert_close_dtype(tko.silu_mul(x.to(DEV)).cpu(), want, max_ulp=2)


def check_rope_store(model_dtype, kv_dtype, H=4, KVH=2, D=16, bs=4, T=7, num_blocks=8, max_pos=64) -> None:
    """Rotated q and k and the cache writes equal HF's apply_rotary_pos_emb and torch's `.to` bit for bit;
    padding rows (negative slots) store nothing."""
    g = torch.Generator().manual_seed(3)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2).to(model_dtype)
    positions = torch.randint(0, max_pos, (T,), generator=g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    slots[torch.tensor([2, T - 2])] = -1  # two padding rows
    cache = torch.randn(num_blocks, 2, 2, bs, KVH, D, generator=g).to(kv_dtype)  # layer 0 of 2: strided views
    cos = torch.cat([cos_sin[positions, :D // 2]] * 2, dim=1).to(model_dtype)  # HF's: [T, D] in the dtype
    sin = torch.cat([cos_sin[positions, D // 2:]] * 2, dim=1).to(model_dtype)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=1)
    want_q, want_k = (hf_rope(x.view(T, -1, D), cos[:, None], sin[:, None]) for x in (q, k))
    want_cache = cache.clone()
    as_bytes = want_cache.view(torch.uint8) if kv_dtype == torch.float8_e5m2 else want_cache
    ok = slots >= 0
    for which, x in ((0, want_k), (1, v.reshape(T, KVH, D))):
        as_bytes[:, 0, which][slots[ok] // bs, slots[ok] % bs] = x[ok].to(kv_dtype).view(as_bytes.dtype)
    qkv_d, cache_d = qkv.to(DEV), cache.to(DEV)
    q_out = torch.empty(T, H, D, dtype=model_dtype, device=DEV)
    tko.rope_store(qkv_d, q_out, cos_sin.to(DEV), positions.to(DEV), cache_d[:, 0, 0], cache_d[:, 0, 1],
                   slots.to(DEV), H)
    assert torch.equal(q_out.cpu(), want_q)
    assert torch.equal(qkv_d.cpu()[:, H * D:(H + KVH) * D].view(T, KVH, D), want_k), "k in qkv is rotated in place"
    assert torch.equal(cache_d.cpu().view(torch.uint8), want_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "norm"])
def test_add_rmsnorm(dtype, with_delta):
    check_add_rmsnorm(dtype, with_delta, 5, 48)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: str(d).split(".")[-1])
def test_silu_mul(dtype):
    check_silu_mul(dtype, 6, 40)


@pytest.mark.parametrize("model_dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.bfloat16, torch.float8_e5m2),
                                                  (torch.float32, torch.float8_e5m2)],
                         ids=lambda x: str(x).split(".")[-1])
def test_rope_store(model_dtype, kv_dtype):
    check_rope_store(model_dtype, kv_dtype)


@triton.jit
def _e5m2_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tko.f32_to_e5m2(tl.load(x_ptr + offs)))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN inputs, in the interpreter
def test_fp8_e5m2_rounding_matches_torch():
    """Every exponent and mantissa pattern, the ties between e5m2 neighbours, subnormals, overflow, NaN."""
    g = torch.Generator().manual_seed(4)
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    ties = torch.arange(1 << 11, dtype=torch.int64) << 21
    bits = torch.cat([top | torch.randint(0, 1 << 16, (1 << 16,), generator=g), ties | 0x100000, ties | 0x0FFFFF,
                      ties | 0x100001, ties])
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, torch.zeros(-x.numel() % 1024)]).to(DEV)  # whole blocks
    y = torch.empty(x.numel(), dtype=torch.uint8, device=DEV)
    _e5m2_kernel[(x.numel() // 1024,)](x, y, BLOCK=1024)
    assert torch.equal(y.cpu(), x.cpu().to(torch.float8_e5m2).view(torch.uint8))


def test_package_is_importable_and_available():
    assert tk.available()
    assert tk.unified_attention is tka.unified_attention and tk.rope_store is tko.rope_store


@pytest.mark.gpu
class TestOnGPU:
    """The same checks, compiled, at a real model's shapes (bf16, block size 16, batch 64)."""

    @pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 32, 8)])
    @pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2], ids=["bf16", "fp8"])
    def test_attention(self, head_dim, heads, kv_heads, kv_dtype):
        g = torch.Generator().manual_seed(5)
        ctx = torch.randint(900, 1100, (64,), generator=g).tolist()
        specs = [(1, c) for c in ctx[:52]] + [(4, c) for c in ctx[52:60]]  # decode and verify rows
        specs += [(300, 0), (200, 700), (1, 0), (0, 0)]  # a prompt, a chunk after context, a first token, padding
        check_attention(make_batch(specs, heads, kv_heads, head_dim, kv_dtype, torch.bfloat16, block_size=16))

    def test_attention_split_kv(self):
        """Few sequences at long contexts: shares of the context in separate programs, then merged."""
        specs = [(1, 7000), (1, 3000), (4, 5000), (1, 10), (0, 0)]
        assert tka.split_count(len(specs), 8, 4, 4) > 1
        check_attention(make_batch(specs, 32, 8, 128, torch.bfloat16, torch.bfloat16, block_size=16))

    def test_fused_ops(self):
        check_add_rmsnorm(torch.bfloat16, True, 64, 4096)
        check_add_rmsnorm(torch.bfloat16, False, 64, 4096)
        check_silu_mul(torch.bfloat16, 64, 11008)
        for kv in (torch.bfloat16, torch.float8_e5m2):
            check_rope_store(torch.bfloat16, kv, H=32, KVH=8, D=128, bs=16, T=64, num_blocks=64, max_pos=4096)

    def test_cuda_graph_replays_for_other_lengths(self):
        """Captured once, a replay reads the lengths, starts and block tables on the device: a batch of
        padding sequences writes nothing, the real batch's values copied in give its attention."""
        specs = [(1, c) for c in range(200, 1000, 50)] + [(4, 300), (64, 100), (1, 0), (0, 0)]
        a = make_batch(specs, 32, 8, 128, torch.bfloat16, torch.bfloat16, block_size=16)
        real = {k: a[k].clone() for k in ("seq_lens", "query_start_loc", "block_tables")}
        out = torch.full_like(a["q"], float("nan"))
        tka.unified_attention(out=out, **a)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tka.unified_attention(out=out, **a)
        for k in ("seq_lens", "query_start_loc", "block_tables"):
            a[k].zero_()
        out.fill_(float("nan"))
        graph.replay()
        assert out.isnan().all()
        for k, v in real.items():
            a[k].copy_(v)
        graph.replay()
        real_rows = int(a["query_start_loc"][-1])
        torch.testing.assert_close(out[:real_rows].cpu().double(), reference_attention(a)[:real_rows], rtol=2e-2,
                                   atol=2e-2)
