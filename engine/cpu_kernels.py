"""CPU kernels of our own, compiled on first use with the system C compiler and loaded with ctypes.

Today one: decode attention read straight from the paged KV cache (`csrc/paged_decode_cpu.c`). It is
built for the machine it runs on (`-march=native`), cached under `~/.cache/pdserve/kernels` (or
`$PDSERVE_CACHE_DIR/kernels`) keyed by the source, the compiler, and the CPU's flags, and linked to
the OpenMP runtime torch already loaded, so both share one thread pool. Without a compiler, or with
`PDSERVE_CPU_KERNELS=0`, the engine keeps its pure-torch path (gather + SDPA): same results, slower.
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

_SRC = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


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


def _build(cc: str) -> Path:
    torch_lib = Path(torch.__file__).parent / "lib"
    gomp = next(iter(sorted(torch_lib.glob("libgomp*.so*"))), None)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([_SRC.read_text(), version, _cpu_flags(), str(gomp)]).encode()).hexdigest()[:16]
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "pdserve")
    out = Path(root) / "kernels" / f"paged_decode_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, so = Path(tmp) / "k.o", Path(tmp) / "k.so"
        flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11"]  # gnu: fused multiply-adds
        subprocess.run([cc, *flags, "-c", str(_SRC), "-o", str(obj)], check=True, capture_output=True, timeout=120)
        # Link to torch's own libgomp when it ships one: the soname matches the copy already loaded in
        # this process, so there is one OpenMP runtime, not two thread pools spinning against each other.
        link = [f"-L{gomp.parent}", f"-l:{gomp.name}", f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-fopenmp"]
        subprocess.run([cc, "-shared", str(obj), "-o", str(so), *link, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(so, out)  # atomic: a concurrent builder (another worker) sees a whole file or none
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("PDSERVE_CPU_KERNELS", "1") in ("0", "false", "no"):
            return None
        cc = _compiler()
        if cc is None:
            logger.warning("no C compiler: decode attention uses the slower gather + SDPA path")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except Exception as exc:  # noqa: BLE001 - any build or load failure: keep the torch path
            detail = getattr(exc, "stderr", b"") or b""
            logger.warning("building the CPU decode-attention kernel failed (%r %s); using gather + SDPA",
                           exc, detail.decode(errors="replace")[-500:])
            return None
        fn = lib.pdserve_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        _lib = lib
        return lib


def paged_decode_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention on `device`/`dtype` can run through the compiled kernel."""
    return device.type == "cpu" and dtype == torch.float32 and _load() is not None


def paged_decode(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float) -> None:
    """Decode attention for `n` single-token sequences, written into `out`.

    q, out: [n, heads, head_dim] fp32 contiguous; k_cache, v_cache: one layer's views of the block-major
    cache, [num_blocks, block_size, kv_heads, head_dim] (dims 1-3 contiguous, blocks strided);
    tables: [n, max_blocks] int32 block ids; lens: [n] int32 context lengths (new token included)."""
    lib = _load()
    assert lib is not None, "paged_decode called without paged_decode_available()"
    n, heads, head_dim = q.shape
    _, block_size, kv_heads, hd = k_cache.shape
    assert hd == head_dim and q.is_contiguous() and out.is_contiguous() and q.dtype == torch.float32
    assert k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and k_cache.stride() == v_cache.stride()
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
    rc = lib.pdserve_paged_decode(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                  k_cache.stride(0), tables.data_ptr(), tables.stride(0), lens.data_ptr(), n, heads,
                                  kv_heads, head_dim, block_size, float(scale), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its scratch")
