"""`TPGroup`: the ranks of one tensor-parallel worker, over a standalone torch.distributed group.

Tensors (all-reduce, logits gather) go through a `ProcessGroupGloo` on a CPU or a `ProcessGroupNCCL` on
CUDA; rank 0's step messages go to the followers through the group's `TCPStore` (hosted by rank 0),
one key per message, so a follower's wait is a store wait it can bound and repeat, and a follower
learns that rank 0 went away when the store's connection breaks.

Not torch's process-wide default group: a process may also hold kv_transfer's pairwise groups.

    rank 0 (LLMEngine)                         rank r > 0 (engine.parallel.worker.run_follower)
    TCPStore(master) -- init_method -------->  TCPStore(client)
    ProcessGroup{Gloo,NCCL}(0, W) <--------->  ProcessGroup{Gloo,NCCL}(r, W)
    send(Step(host inputs)): store["tp/m<n>"] -> recv(): wait on "tp/m<n>"
    forward on its shard   <-- all_reduce -->  forward on its shard
    logits [rows, V]       <-- gather -------  its vocab slice of the logits
"""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MESSAGE_KEY = "pdserve-tp/m"
DEFAULT_TIMEOUT_S = 120.0


class LeaderGone(RuntimeError):
    """Rank 0 went away (its store closed) or stayed silent past a follower's idle limit."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _timed_out(err: Exception) -> bool:
    msg = str(err)
    return "imed out" in msg or "imeout" in msg


def parse_init_method(init_method: str) -> tuple[str, int]:
    """`tcp://host:port` -> (host, port)."""
    if not init_method.startswith("tcp://"):
        raise ValueError(f"init_method must look like tcp://host:port, got {init_method!r}")
    host, _, port = init_method[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def leader_store(world: int, host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, str]:
    """Rank 0's store on a free port of `host` (bound to `host` only), and the init_method followers connect to."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family, backlog=64)
    port = sock.getsockname()[1]
    # NOTE: the store owns the descriptor from here on and closes it when it is destroyed.
    store = dist.TCPStore(host, port, world, True, timeout=_td(timeout_s), wait_for_workers=False,
                          master_listen_fd=sock.detach())
    h = f"[{host}]" if ":" in host else host
    return store, f"tcp://{h}:{port}"


class TPGroup:
    """One tensor-parallel worker's ranks. Every rank calls the collectives in the same order.

    `TPGroup.single()` is world 1: no group, every collective returns its input, and the model takes
    exactly the single-device path."""

    def __init__(self, rank: int, world: int, store: dist.Store | None = None, pg=None,
                 device: torch.device | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        assert 0 <= rank < world
        self.rank, self.world = rank, world
        self.store, self.pg = store, pg
        self.device = device or torch.device("cpu")
        self.timeout_s = timeout_s
        self._seq = 0  # messages sent (rank 0) or received (followers)
        self._last_was_step = False
        self.closed = False
        # NOTE: rank 0 holds it from a message's send to the end of the collectives that answer it (a
        # step's forward, a KV gather or scatter): the ranks must see one message stream and call the
        # collectives in one order, and rank 0's threads (the step loop, a KV transfer) take turns.
        self.lock = threading.RLock()

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def connect(cls, rank: int, world: int, init_method: str, device: str | torch.device = "cpu",
                timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.TCPStore | None = None) -> TPGroup:
        """Join the group: rank 0 passes the store `leader_store` made (`init_method` is its address),
        followers connect to it. Blocks until all `world` ranks have joined (at most `timeout_s`).
        `timeout_s` also bounds every collective afterwards (a rank that died fails the others' steps)."""
        device = torch.device(device)
        if store is None:
            if rank == 0:
                raise ValueError("rank 0 hosts the store: make it with leader_store() and pass it")
            host, port = parse_init_method(init_method)
            store = dist.TCPStore(host, port, world, False, timeout=_td(timeout_s))
        prefix = dist.PrefixStore("pdserve-tp", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(timeout_s)
            pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(timeout_s)
            host = parse_init_method(init_method)[0]
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            pg = dist.ProcessGroupGloo(prefix, rank, world, opts)
        return cls(rank, world, store, pg, device, timeout_s)

    # ------------------------------------------------------------------ tensors
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`."""
        if self.world > 1:
            self.pg.allreduce([t]).wait(_td(self.timeout_s))
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' `t` concatenated along the last dim (rank order); other ranks: None."""
        if self.world == 1:
            return t
        parts = self.gather_list(t)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def gather_list(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's `t` (same shape and dtype on every rank), in rank order; others: None."""
        if self.world == 1:
            return [t]
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.world)]
            self.pg.gather([parts], [t], opts).wait(_td(self.timeout_s))
            return parts
        self.pg.gather([], [t], opts).wait(_td(self.timeout_s))
        return None

    def scatter_list(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0 passes one tensor per rank (each shaped like `out`); every rank gets its own in `out`."""
        if self.world == 1:
            return out.copy_(parts[0])
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        if self.rank == 0:
            assert parts is not None and len(parts) == self.world
            self.pg.scatter([out], [[p.contiguous() for p in parts]], opts).wait(_td(self.timeout_s))
        else:
            self.pg.scatter([out], [], opts).wait(_td(self.timeout_s))
        return out

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (every rank gets it)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait(_td(self.timeout_s))
        return int(t.item())

    # ------------------------------------------------------------------ messages (rank 0 -> followers)
    def send(self, msg: Any, is_step: bool = True) -> None:
        """Rank 0: hand `msg` to every follower. `is_step`: the followers answer it with collectives.

        NOTE: the previous message's key is deleted only when that message was a step: rank 0 got
        through its collectives, so every follower had read it."""
        assert self.rank == 0 and self.world > 1
        self._seq += 1
        self.store.set(f"{MESSAGE_KEY}{self._seq}", pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        if self._seq > 1 and self._last_was_step:
            self.store.delete_key(f"{MESSAGE_KEY}{self._seq - 1}")
        self._last_was_step = is_step

    def recv(self, poll_s: float = 30.0, idle_timeout_s: float | None = None) -> Any:
        """A follower's next message from rank 0. Waits `poll_s` at a time while rank 0's store answers;
        raises `LeaderGone` when it does not (rank 0's process ended: the pending wait fails at once,
        its connection closed) or after `idle_timeout_s` without a message (None: no idle limit).

        NOTE: c10d logs a warning at each wait that times out: a long `poll_s` keeps an idle
        follower's log quiet; it does not delay noticing rank 0's end."""
        assert self.rank > 0
        key = f"{MESSAGE_KEY}{self._seq + 1}"
        t0 = time.monotonic()
        while True:
            try:
                self.store.wait([key], _td(poll_s))
                break
            except Exception as e:  # noqa: BLE001 - the store raises RuntimeError / DistStoreError variants
                if not _timed_out(e):
                    raise LeaderGone(f"rank 0's store is gone: {str(e).splitlines()[0] if str(e) else e!r}") from e
            if idle_timeout_s is not None and time.monotonic() - t0 > idle_timeout_s:
                raise LeaderGone(f"no message from rank 0 in {idle_timeout_s:.0f} s")
        try:
            data = self.store.get(key)
        except Exception as e:  # noqa: BLE001
            raise LeaderGone(f"rank 0's store is gone: {e!r}") from e
        self._seq += 1
        return pickle.loads(data)

    def close(self) -> None:
        """Drop the process group (its sockets close; peers' pending collectives fail)."""
        if self.closed:
            return
        self.closed = True
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                if hasattr(pg, "abort"):
                    pg.abort()
                elif hasattr(pg, "shutdown"):
                    pg.shutdown()
            except Exception:  # noqa: BLE001 - closing a group whose peers are already gone
                logger.debug("closing the TP group", exc_info=True)
