"""CPU workers of one node share its cores by how many of them have work.

With a fixed split, a pool's cores are lost whenever it idles: 1 prefill + 1 decode worker of one
thread each on 2 cores step a lone decoding request on one core while the other core waits for a
prompt. Here each CPU worker steps on `max(num_threads, cores // busy)` threads, where `busy` counts
the node's workers that have unfinished requests (itself included), read again before every step.
When both pools are busy each keeps its own share. A worker that just got work waits (up to
ROOM_WAIT_S) until the busy peers' current steps end and they step on fewer threads: more threads
than cores, GNU OpenMP's spinning teams stall one another (measured on 2 cores: without that wait,
TTFT p50 at concurrency 8 was 1.38x that of a fixed split).

How the workers see each other, with no Ray call and nothing to clean up after a crash: each holds an
exclusive `flock` on a file of its own in a node-local directory while it has work, and writes there
the threads it steps on; the others count the files whose lock they cannot take, and read them. A
dead worker's lock goes with its process, so it never counts as busy. The directory is named after
the Ray node, so only workers of one raylet share.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

# How often the directory is listed again for workers that came or went.
RELIST_S = 1.0
# A worker that just got work waits at most this long for busy peers to step on fewer threads, and
# polls this often meanwhile.
ROOM_WAIT_S = 0.2
ROOM_POLL_S = 0.001


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
        self._published = 0  # the threads written to this worker's file (0: none yet)
        self._peers: dict[str, int] = {}
        self._listed = float("-inf")

    @property
    def busy(self) -> bool:
        return self._busy

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            fcntl.flock(self._fd, fcntl.LOCK_EX if busy else fcntl.LOCK_UN)
            self._busy = busy

    def _busy_peer_threads(self) -> list[int]:
        """Threads each of the node's other busy workers (those holding their lock) steps on now."""
        if time.monotonic() - self._listed > RELIST_S:
            self._relist()
        out = []
        for fd in self._peers.values():
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                out.append(os.pread(fd, 1, 0)[:1] or b"\x01")
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return [b[0] for b in out]

    def busy_peers(self) -> int:
        """The node's other workers that have work now."""
        return len(self._busy_peer_threads())

    def threads(self) -> int:
        """Threads for this worker's next step, while it has work."""
        return max(self.floor, self.cores // (1 + self.busy_peers()))

    def claim(self, threads: int, newly_busy: bool) -> None:
        """Say this worker's next step runs on `threads`; one that `newly_busy` got work first waits
        (up to ROOM_WAIT_S) until that many are free of the busy peers' threads."""
        if threads != self._published:
            os.pwrite(self._fd, bytes([min(threads, 255)]), 0)
            self._published = threads
        if not newly_busy:
            return
        deadline = time.monotonic() + ROOM_WAIT_S
        while sum(self._busy_peer_threads()) + threads > self.cores and time.monotonic() < deadline:
            time.sleep(ROOM_POLL_S)

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
