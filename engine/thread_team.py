"""One OpenMP thread team per process, owned by the thread that steps the engine.

GNU OpenMP (the runtime torch's CPU build uses) keeps a pool of worker threads for every thread that
ever opened a parallel region with more than one thread, and keeps them for the life of that thread.
Once a process holds more of those workers than it has CPUs, every team stops spinning between
parallel regions (libgomp's "throttled" spin: about a hundred iterations instead of a few
milliseconds) and its workers sleep in the kernel after each region. A decode step opens a few
hundred regions, so each one pays a wake-up. Measured on a 2-core host, SmolLM2-135M, one
sequence: 32 ms per decode step while only the stepping thread used OpenMP, 41-43 ms once one other
thread had opened a two-thread region: the thread that loaded the model, or a Ray pool thread
copying KV blocks. That was most of the gap between the engine alone and the served engine.

So a process that steps an engine on a thread of its own:
  * `confine(device, num_threads)` on the thread that built the engine: torch's process-wide thread
    count drops to 1, so every other thread (Ray's pool threads, KV copies, the thread that built the engine) runs its
    torch ops on itself and opens no team; and the calling thread's own workers are let go;
  * `Team.own()` (the `Team` confine returns) first thing on the stepping thread: that thread's
    teams have the engine's thread count.
GNU OpenMP keeps the thread count per thread, which is what makes this possible. Where torch runs on
another OpenMP runtime (or on a GPU) `confine` changes nothing and returns None: the process keeps
one shared thread count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the calling thread's pool, keep the runtime


def _loaded_gomp() -> Path | None:
    """The GNU OpenMP library this process has loaded (torch's own copy in its wheels)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 6 and Path(fields[5]).name.startswith("libgomp"):
            return Path(fields[5])
    return None


@functools.cache
def gomp() -> ctypes.CDLL | None:
    """Handle on the GNU OpenMP runtime torch runs on, or None (another runtime, or no OpenMP)."""
    if "OpenMP" not in torch.__config__.parallel_info() or (path := _loaded_gomp()) is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        lib.omp_pause_resource_all.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError) as exc:
        logger.info("thread team: %s has no usable OpenMP API (%s)", path, exc)
        return None


@dataclass(frozen=True, slots=True)
class Team:
    """What `confine` took from the process: `own` on the stepping thread, `give_back` when the
    engine is done with the process (an in-process backend that shuts down)."""
    num_threads: int  # the stepping thread's
    process_threads: int  # torch's process-wide count before `confine`

    def own(self) -> None:
        """First thing on the thread that steps the engine: its parallel regions use `num_threads`
        threads; every other thread keeps torch's process-wide count (1)."""
        torch.get_num_threads()  # torch sets each thread's count from its process-wide one on first use
        gomp().omp_set_num_threads(self.num_threads)

    def resize(self, num_threads: int) -> None:
        """On the stepping thread: its next parallel regions use `num_threads` threads (the pool
        GNU OpenMP keeps for this thread grows to the largest count asked, and stays)."""
        gomp().omp_set_num_threads(num_threads)

    def give_back(self) -> None:
        torch.set_num_threads(self.process_threads)


def confine(device: str | torch.device, num_threads: int | None) -> Team | None:
    """Called by the thread that built a CPU engine another thread will step (`num_threads`: the
    engine's setting; None, torch's count now): other threads run torch ops on one thread from now
    on, and this thread's OpenMP workers exit. None off the CPU or without GNU OpenMP: then nothing
    changed and there is nothing to own."""
    lib = gomp()
    if lib is None or torch.device(device).type != "cpu":
        return None
    process_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lib.omp_pause_resource_all(_OMP_PAUSE_SOFT)
    return Team(max(1, int(num_threads or process_threads)), process_threads)
