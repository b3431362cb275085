"""CPU kernels of our own, compiled on first use with the system C compiler and loaded with ctypes.

Two sources, built into one library per model shape (see `_libs`):
  * `csrc/paged_decode_cpu.c`: decode attention read straight from the paged KV cache, one copy of
    `csrc/paged_decode_impl.h` per KV element type (fp32, bf16, fp16, fp8 e5m2: `csrc/kv_types.h`);
  * `csrc/decode_ops_cpu.c`: the small per-token ops of a layer, fused (rotary embedding + KV-cache
    write, residual add + RMSNorm, SiLU x up), built with `-ffp-contract=off` so the elementwise
    ones round exactly as torch's do;
  * `csrc/vec_math.h`: the vector exp both use.
All the math is fp32. The cache's elements may be narrower, and on the CPU's bf16 path the RMSNorm
output and SiLU x up read or write bf16 (the products' inputs), rounded once as torch's `.to` rounds.
A library is built for the machine it runs on (`-march=native`) and, for decode attention's register
path, for one (query heads per KV head, head_dim) shape (`prepare_decode`); it is cached under
`~/.cache/pdserve/kernels` (or `$PDSERVE_CACHE_DIR/kernels`) keyed by the sources, the shape, the
compiler, and the CPU's flags, and linked to the OpenMP runtime torch already loaded, so both share one thread pool.
Without a compiler, or with `PDSERVE_CPU_KERNELS=0`, the engine keeps its pure-torch path (gather +
SDPA, torch ops): same results up to rounding, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# (source, extra compiler flags). gnu11 allows fused multiply-adds; the fused ops turn them off.
_SOURCES = ((_CSRC / "paged_decode_cpu.c", ()), (_CSRC / "decode_ops_cpu.c", ("-ffp-contract=off",)))
# The KV cache element types the kernels read and write: dtype -> (kv_types.h's enum, symbol suffix).
_KV_KINDS = {torch.float32: (0, "f32"), torch.bfloat16: (1, "bf16"), torch.float8_e5m2: (2, "e5m2"),
             torch.float16: (3, "f16")}
_lock = threading.Lock()
# Loaded libraries by shape: None is the generic one (fused ops, and decode attention one element at a
# time); (group, head_dim) adds the register-resident decode path for that shape only, so a build
# compiles 4 copies of it (one per KV type), not every shape's: a few seconds, not a minute.
_libs: dict[tuple[int, int] | None, ctypes.CDLL | None] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(cc: str, shape: tuple[int, int] | None) -> Path:
    torch_lib = Path(torch.__file__).parent / "lib"
    gomp = next(iter(sorted(torch_lib.glob("libgomp*.so*"))), None)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [f"{src.read_text()}{flags}" for src, flags in _SOURCES] + [h.read_text() for h in sorted(_CSRC.glob("*.h"))]
    defines = [] if shape is None else [f"-DPDSERVE_GROUP={shape[0]}", f"-DPDSERVE_HEAD_DIM={shape[1]}"]
    key = hashlib.sha256("\0".join([*parts, version, _cpu_flags(), str(gomp), *defines]).encode()).hexdigest()[:16]
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "pdserve")
    tag = "generic" if shape is None else f"g{shape[0]}-d{shape[1]}"
    out = Path(root) / "kernels" / f"pdserve_cpu-{tag}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / "k.so"
        flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11"]
        objs = []
        for i, (src, extra) in enumerate(_SOURCES):
            objs.append(str(Path(tmp) / f"k{i}.o"))
            subprocess.run([cc, *flags, *extra, *defines, f"-I{_CSRC}", "-c", str(src), "-o", objs[-1]], check=True,
                           capture_output=True, timeout=300)
        # Link to torch's own libgomp when it ships one: the soname matches the copy already loaded in
        # this process, so there is one OpenMP runtime, not two thread pools spinning against each other.
        link = [f"-L{gomp.parent}", f"-l:{gomp.name}", f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-fopenmp"]
        subprocess.run([cc, "-shared", *objs, "-o", str(so), *link, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(so, out)  # atomic: a concurrent builder (another worker) sees a whole file or none
    return out


def _load(shape: tuple[int, int] | None = None) -> ctypes.CDLL | None:
    """The library for `shape` ((query heads per KV head, head_dim), or None: generic), built on first use."""
    with _lock:
        if shape in _libs:
            return _libs[shape]
        _libs[shape] = None
        if os.environ.get("PDSERVE_CPU_KERNELS", "1") in ("0", "false", "no"):
            return None
        cc = _compiler()
        if cc is None:
            if shape is None:
                logger.warning("no C compiler: decode attention and the per-token ops use the slower torch path")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc, shape)))
        except Exception as exc:  # noqa: BLE001 - any build or load failure: keep the torch path
            detail = getattr(exc, "stderr", b"") or b""
            logger.warning("building the CPU kernels (%s) failed (%r %s); using %s", shape or "generic", exc,
                           detail.decode(errors="replace")[-500:],
                           "the torch path (gather + SDPA)" if shape is None else "the generic decode attention")
            return None
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        for suffix in _KV_KINDS.values():
            fn = getattr(lib, f"pdserve_paged_decode_{suffix[1]}")
            fn.restype = ctypes.c_int
            fn.argtypes = [p, p, p, p, i64, p, i64, p, i32, i32, i32, i32, i32, f32, i32]
        lib.pdserve_rope_store.restype = None
        lib.pdserve_rope_store.argtypes = [p, p, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, i32]
        lib.pdserve_add_rmsnorm.restype = None
        lib.pdserve_add_rmsnorm.argtypes = [p, p, p, f32, p, i32, i32, i32, i32]
        lib.pdserve_silu_mul.restype = None
        lib.pdserve_silu_mul.argtypes = [p, p, i32, i32, i32]
        lib.pdserve_silu_mul_bf16.restype = None
        lib.pdserve_silu_mul_bf16.argtypes = [p, p, i32, i32, i32]
        lib.pdserve_argmax_rows.restype = None
        lib.pdserve_argmax_rows.argtypes = [p, p, i32, i64, i32]
        _libs[shape] = lib
        return lib


def _register_shape(group: int, head_dim: int) -> tuple[int, int] | None:
    """The shapes the kernel keeps in vector registers (see PDSERVE_GROUP in paged_decode_impl.h)."""
    return (group, head_dim) if 1 <= group <= 8 and head_dim % 32 == 0 and head_dim <= 128 else None


def prepare_decode(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Build (or load from the cache) the decode attention specialised for this model's shape; False
    when the shape has no register path or the build failed (the generic kernel still runs)."""
    shape = _register_shape(heads // kv_heads, head_dim)
    return shape is not None and _load(shape) is not None


def available(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the compiled kernels (decode attention and the fused per-token ops) run on `device` for
    a model in `dtype` with its KV cache in `kv_dtype` (None: the model's dtype)."""
    return (device.type == "cpu" and dtype == torch.float32 and (kv_dtype or dtype) in _KV_KINDS
            and _load() is not None)


def paged_decode(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float) -> None:
    """Decode attention for `n` single-token sequences, written into `out`.

    q, out: [n, heads, head_dim] fp32 contiguous; k_cache, v_cache: one layer's views of the block-major
    cache, [num_blocks, block_size, kv_heads, head_dim] (dims 1-3 contiguous, blocks strided), in any
    of the element types fp32, bf16, fp16 and fp8 e5m2;
    tables: [n, max_blocks] int32 block ids; lens: [n] int32 context lengths (new token included)."""
    n, heads, head_dim = q.shape
    _, block_size, kv_heads, hd = k_cache.shape
    lib = _libs.get(_register_shape(heads // kv_heads, head_dim)) or _load()
    assert lib is not None, "paged_decode called without available()"
    assert hd == head_dim and q.is_contiguous() and out.is_contiguous() and q.dtype == torch.float32
    assert k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and k_cache.stride() == v_cache.stride()
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
    fn = getattr(lib, f"pdserve_paged_decode_{_KV_KINDS[k_cache.dtype][1]}")
    rc = fn(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.stride(0), tables.data_ptr(), tables.stride(0), lens.data_ptr(), n, heads,
            kv_heads, head_dim, block_size, float(scale), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its scratch")


def rope_store(qkv: torch.Tensor, q_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, heads: int) -> None:
    """Rotary embedding and KV-cache write for one layer, in one pass.

    qkv: [T, (heads + 2 kv_heads) * head_dim] contiguous, the fused q/k/v projection; its k part is
    rotated in place. q_out: [T, heads, head_dim] contiguous, receives the rotated queries. cos, sin:
    [T, head_dim] contiguous. k_cache, v_cache: one layer's views of the cache (as `paged_decode`);
    k and v are stored rounded to its element type as torch's `.to` rounds. slot_blocks, slot_offsets:
    [T] int64, where each token's K/V row goes."""
    lib = _load()
    assert lib is not None, "rope_store called without available()"
    _, block_size, kv_heads, head_dim = k_cache.shape
    T = qkv.shape[0]
    assert qkv.is_contiguous() and q_out.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert qkv.shape[1] == (heads + 2 * kv_heads) * head_dim and cos.shape == (T, head_dim) and head_dim <= 512
    assert k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and k_cache.stride() == v_cache.stride()
    assert slot_blocks.dtype == torch.int64 and slot_offsets.dtype == torch.int64
    assert slot_blocks.is_contiguous() and slot_offsets.is_contiguous() and slot_blocks.numel() == T
    lib.pdserve_rope_store(qkv.data_ptr(), q_out.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                           v_cache.data_ptr(), k_cache.stride(0), slot_blocks.data_ptr(), slot_offsets.data_ptr(),
                           T, heads, kv_heads, head_dim, _KV_KINDS[k_cache.dtype][0], torch.get_num_threads())


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF's RMSNorm of `x` ([T, n] contiguous fp32), after `x += delta` in place when `delta` is given;
    returned in `out_dtype` (fp32, or bf16: the fp32 result rounded once, as `.to` rounds it)."""
    lib = _load()
    assert lib is not None, "add_rmsnorm called without available()"
    assert x.is_contiguous() and weight.is_contiguous() and x.dtype == torch.float32 and x.shape[1] == weight.numel()
    assert out_dtype in (torch.float32, torch.bfloat16)
    if delta is not None:
        assert delta.is_contiguous() and delta.shape == x.shape
    y = torch.empty_like(x, dtype=out_dtype)
    lib.pdserve_add_rmsnorm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), float(eps),
                            y.data_ptr(), x.shape[0], x.shape[1], int(out_dtype == torch.bfloat16),
                            torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` = [T, 2n] contiguous fp32 or bf16 (gate, then up); returns [T, n]
    in the same dtype (bf16: computed in fp32, rounded once)."""
    lib = _load()
    assert lib is not None, "silu_mul called without available()"
    assert gate_up.is_contiguous() and gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.shape[1] % 2 == 0
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    fn = lib.pdserve_silu_mul if gate_up.dtype == torch.float32 else lib.pdserve_silu_mul_bf16
    fn(gate_up.data_ptr(), y.data_ptr(), T, n, torch.get_num_threads())
    return y


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x.argmax(dim=-1)` for `x` = [rows, n] contiguous fp32 on the CPU (same index: the first
    maximum, or the first NaN), or None where the library is not loaded (the caller uses torch's)."""
    lib = _libs.get(None)
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        return None
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.pdserve_argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out
