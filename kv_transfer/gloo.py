"""CPU transport: a standalone 2-rank `ProcessGroupGloo` per peer, each with its own `TCPStore`.

Not torch's process-wide default group (nor `ray.util.collective`, which uses it): a process can be in
any number of pairs at once, and pairs come and go with scaling.

    exporter (rank 0)                         importer (rank 1)
    listen(peer) -> (host, port) ---------->  connect(peer, (host, port))
      TCPStore(is_master, port 0)               TCPStore(client)
      ProcessGroupGloo(rank 0)  <-- rendezvous --> ProcessGroupGloo(rank 1)
      (in a thread: it blocks until the peer joins)
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist

from kv_transfer.errors import KVTransferError, PeerDiedError, TransferTimeoutError
from kv_transfer.transport import Channel, Pending, Transport

logger = logging.getLogger(__name__)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _typed(err: Exception, what: str) -> KVTransferError:
    msg = str(err)
    if "imed out" in msg or "imeout" in msg:
        return TransferTimeoutError(f"{what}: {msg.splitlines()[0] if msg else err!r}")
    return PeerDiedError(f"{what}: {msg.splitlines()[0] if msg else err!r}")


class _GlooPending:
    def __init__(self, channel: GlooChannel, work, what: str):
        self.channel, self.work, self.what = channel, work, what

    def wait(self, timeout_s: float) -> None:
        try:
            self.work.wait(_td(timeout_s))
        except Exception as e:  # gloo raises RuntimeError / DistBackendError with the socket's story
            self.channel.broken = True
            raise _typed(e, f"{self.what} {self.channel.peer!r}") from e


class GlooChannel(Channel):
    def __init__(self, peer: str, rank: int, store: dist.Store, timeout_s: float):
        super().__init__(peer)
        self.rank = rank
        self.store = store  # NOTE: keep the store alive as long as the group: rank 0 hosts it
        self.timeout_s = timeout_s
        self._pg: dist.ProcessGroupGloo | None = None
        self._ready = threading.Event()
        self._error: Exception | None = None

    def _rendezvous(self, host: str) -> None:
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(self.timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("pdserve-kv", self.store), self.rank, 2, opts)
        except Exception as e:
            self._error = e
            self.broken = True
        finally:
            self._ready.set()

    def _group(self) -> dist.ProcessGroupGloo:
        if not self._ready.wait(self.timeout_s):
            self.broken = True
            raise TransferTimeoutError(f"peer {self.peer!r} did not join the gloo channel in {self.timeout_s:.1f}s")
        if self._pg is None:
            raise _typed(self._error or RuntimeError("channel closed"), f"gloo channel to {self.peer!r}")
        return self._pg

    def isend(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        try:
            work = self._group().send([tensor], 1 - self.rank, tag)
        except KVTransferError:
            raise
        except Exception as e:
            self.broken = True
            raise _typed(e, f"send to {self.peer!r}") from e
        return _GlooPending(self, work, "send to")

    def irecv(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        try:
            work = self._group().recv([tensor], 1 - self.rank, tag)
        except KVTransferError:
            raise
        except Exception as e:
            self.broken = True
            raise _typed(e, f"recv from {self.peer!r}") from e
        return _GlooPending(self, work, "recv from")

    def close(self) -> None:
        super().close()
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()  # wakes any thread still blocked on this group, closes the sockets
            except Exception:  # already torn down by the peer
                logger.debug("abort of gloo channel to %s failed", self.peer, exc_info=True)


class GlooTransport(Transport):
    """Gloo channels. `host` must be this node's IP as the peer can reach it (never 0.0.0.0)."""

    def __init__(self, host: str, timeout_s: float = 30.0):
        super().__init__()
        assert host and host != "0.0.0.0", "give the node IP the peer connects to"
        self.host = host
        self.timeout_s = timeout_s

    def listen(self, peer: str) -> tuple[str, int]:
        """Host a new channel to `peer` (rank 0) and return the (host, port) it must `connect` to.

        Replaces any existing channel to `peer`; the group forms in the background once it joins.
        """
        store = dist.TCPStore(self.host, 0, 2, True, timeout=_td(self.timeout_s), wait_for_workers=False)
        ch = GlooChannel(peer, 0, store, self.timeout_s)
        threading.Thread(target=ch._rendezvous, args=(self.host,), daemon=True,
                         name=f"gloo-listen-{peer}").start()
        self._add(ch)
        return self.host, store.port

    def connect(self, peer: str, address: tuple[str, int]) -> None:
        """Join the channel `peer` is hosting at `address` = (host, port), as rank 1; blocks until it
        is formed."""
        host, port = address
        try:
            store = dist.TCPStore(host, port, 2, False, timeout=_td(self.timeout_s))
        except Exception as e:
            raise _typed(e, f"connect to {peer!r} at {host}:{port}") from e
        ch = GlooChannel(peer, 1, store, self.timeout_s)
        ch._rendezvous(self.host)
        ch._group()
        self._add(ch)
