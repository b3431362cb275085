"""CPU workers of one node share its cores by how many of them have work.

With a fixed split, a pool's cores are lost whenever it idles: 1 prefill + 1 decode worker of one
thread each on 2 cores step a lone decoding request on one core while the other core waits for a
prompt. Here each CPU worker steps on `max(num_threads, cores // busy)` threads, where `busy` counts
the node's workers that have unfinished requests (itself included), read again before every step.
When both pools are busy each keeps its own share, so nothing is oversubscribed for longer than the
step during which the other worker got work.

How the workers see each other, with no Ray call and nothing to clean up after a crash: each holds an
exclusive `flock` on a file of its own in a node-local directory while it has work; the others count
the files whose lock they cannot take. A dead worker's lock goes with its process, so it never counts
as busy. The directory is named after the Ray node, so only workers of one raylet share.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

# How often the directory is listed again for workers that came or went.
RELIST_S = 1.0


def node_cores(ray_cpus: float | None) -> int:
    """The cores the node's workers share: this process's CPU affinity, no more than the node's Ray
    CPUs (`ray_cpus`; None: not known)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, int(ray_cpus)) if ray_cpus else cores)


def share_dir(node_id: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"pdserve-cores-{node_id[:24]}"


class CoreShare:
    """One worker's view of its node's cores. Only the worker's step loop calls it."""

    def __init__(self, directory: Path, name: str, cores: int, floor: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.name = name
        self.cores = cores
        self.floor = max(1, floor)
        self._fd = os.open(directory / name, os.O_CREAT | os.O_RDWR, 0o600)
        self._busy = False
        self._peers: dict[str, int] = {}
        self._listed = float("-inf")

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            fcntl.flock(self._fd, fcntl.LOCK_EX if busy else fcntl.LOCK_UN)
            self._busy = busy

    def busy_peers(self) -> int:
        """The node's other workers that hold their lock (have work) now."""
        if time.monotonic() - self._listed > RELIST_S:
            self._relist()
        n = 0
        for fd in self._peers.values():
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                n += 1
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return n

    def threads(self) -> int:
        """Threads for this worker's next step, while it has work."""
        return max(self.floor, self.cores // (1 + self.busy_peers()))

    def _relist(self) -> None:
        self._listed = time.monotonic()
        try:
            names = {p.name for p in self.directory.iterdir()} - {self.name}
        except OSError:
            names = set()
        for gone in self._peers.keys() - names:
            os.close(self._peers.pop(gone))
        for new in names - self._peers.keys():
            try:
                self._peers[new] = os.open(self.directory / new, os.O_RDONLY)
            except OSError:  # removed meanwhile
                pass

    def close(self) -> None:
        """Leave the node's share: the file goes, and with it this worker's count."""
        for fd in self._peers.values():
            os.close(fd)
        self._peers.clear()
        try:
            os.unlink(self.directory / self.name)
        except OSError:
            pass
        os.close(self._fd)
