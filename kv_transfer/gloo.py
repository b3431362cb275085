"""CPU transport: a standalone 2-rank `ProcessGroupGloo` per peer, each with its own `TCPStore`.

Not torch's process-wide default group (nor `ray.util.collective`, which uses it): a process can be in
any number of pairs at once, and pairs come and go with scaling.

    exporter (rank 0)                         importer (rank 1)
    listen(peer) -> (host, port) ---------->  connect(peer, (host, port))
      TCPStore(is_master) on a socket           TCPStore(client)
        bound to host only
      ProcessGroupGloo(rank 0)  <-- rendezvous --> ProcessGroupGloo(rank 1)
      (in a thread: it blocks until the peer joins)
      waits for JOINED_KEY  <-------------------  sets JOINED_KEY
      both drop their store: its listener closes

What listens, and for how long (checked with `ss -ltn` on torch 2.13, tests/kv_transfer/test_gloo_listeners.py):
- the rendezvous store. `TCPStore(host, ..., is_master=True)` listens on every interface whatever
  `host` says, so the master gets a socket bound to `host` alone (`master_listen_fd`). It lives
  only until both ranks have formed the group: the group keeps no reference to it (it holds a
  `_DroppableStore` whose inner store is let go), and the group never uses it again.
- each rank's gloo device, bound to `host` (`create_device(hostname=host)`), until the channel
  closes (`close` aborts the group and drops it, which closes the device's socket).

Who may join: the exporter's `listen` makes a random secret per pair and returns it in the address
(`GlooAddress`), which reaches the importer only inside a Ray call (the router hands it on). Each rank
signs every value it writes to the rendezvous store (HMAC-SHA256 under the secret, over key and value)
and refuses a value it reads without a valid signature, so a stranger who connects to the store can
neither give rank 0 its own address nor learn where rank 0's device listens (tests/kv_transfer/
test_gloo_listeners.py: a stranger's join fails and the pair's transfers fail with it). A stranger
can still spoil a pair's rendezvous (an unsigned value where the peer's belongs fails the pair, which
the router then opens again): a denial of service, not a read; keep the KV ports to the cluster network.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import secrets
import socket
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

from kv_transfer.errors import KVTransferError, PeerDiedError, TransferTimeoutError
from kv_transfer.transport import Channel, Pending, Transport

logger = logging.getLogger(__name__)


JOINED_KEY = "pdserve-kv-joined"  # set by rank 1 once its group is formed: rank 0 may drop the store


_MAC_BYTES = 32


class GlooAddress(NamedTuple):
    """Where the importer joins a pair (`connect`), and the pair's secret."""

    host: str
    port: int
    secret: bytes


class _DroppableStore(dist.Store):
    """What the group gets instead of the TCP store itself: once the group is formed, `drop` lets go of
    the store, so that it is destroyed (and the master's listener closed) although the group lives on.
    Values are signed under the pair's `secret` on `set` and checked on `get` (see the module doc)."""

    def __init__(self, inner: dist.Store, secret: bytes):
        super().__init__()
        self._inner: dist.Store | None = inner
        self._secret = secret

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _store(self) -> dist.Store:
        if self._inner is None:
            raise RuntimeError("the rendezvous store is closed")
        return self._inner

    def drop(self) -> None:
        self._inner = None

    def set(self, key, value):
        value = value.encode() if isinstance(value, str) else bytes(value)
        return self._store().set(key, value + self._mac(key, value))

    def get(self, key):
        raw = bytes(self._store().get(key))
        value, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if len(raw) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
            raise PermissionError(f"the rendezvous store's {key!r} is not signed with this pair's secret: "
                                  "someone else joined")
        return value

    def add(self, key, value):
        return self._store().add(key, value)

    def compare_set(self, key, expected, desired):
        return self._store().compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self._store().wait(keys) if timeout is None else self._store().wait(keys, timeout)

    def check(self, keys):
        return self._store().check(keys)

    def delete_key(self, key):
        return self._store().delete_key(key)

    def num_keys(self):
        return self._store().num_keys()

    def set_timeout(self, timeout):
        return self._store().set_timeout(timeout)


def _master_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A TCP store master listening on `host` only (not every interface, as TCPStore binds by itself)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family, backlog=16)
    # NOTE: the store owns the descriptor from here on and closes it when it is destroyed
    return dist.TCPStore(host, 0, 2, True, timeout=_td(timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())


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
    def __init__(self, peer: str, rank: int, store: dist.Store, timeout_s: float, secret: bytes):
        super().__init__(peer)
        self.rank = rank
        self.store: _DroppableStore | None = _DroppableStore(store, secret)  # until the group is formed
        self.timeout_s = timeout_s
        self._pg: dist.ProcessGroupGloo | None = None
        self._ready = threading.Event()
        self._error: Exception | None = None

    def _rendezvous(self, host: str) -> None:
        store, pg = self.store, None
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(self.timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            pg = dist.ProcessGroupGloo(dist.PrefixStore("pdserve-kv", store), self.rank, 2, opts)
            if self.rank == 1:
                store.set(JOINED_KEY, b"1")
            else:  # the store must outlive the peer's last use of it
                store.wait([JOINED_KEY], _td(self.timeout_s))
            if self.broken:  # closed while the peer joined
                pg.abort()
            else:
                self._pg = pg
        except Exception as e:
            if pg is not None and self._pg is not pg:
                pg.abort()
            self._error = e
            self.broken = True
        finally:
            self._drop_store()
            self._ready.set()

    def _drop_store(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.drop()

    @property
    def listening(self) -> bool:
        """Whether this channel still holds its rendezvous store (rank 0: a listening socket)."""
        return self.store is not None

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
                # NOTE: on torch 2.13 this does not wake a thread blocked in a receive on this group
                # (it waits out its timeout); a peer that died wakes it within about a second, when
                # its socket closes. A wait cannot be cut into slices: gloo closes the pair on timeout.
                pg.abort()
            except Exception:  # already torn down by the peer
                logger.debug("abort of gloo channel to %s failed", self.peer, exc_info=True)
        # NOTE: the group's device socket closes once the last reference to the group goes (the one
        # dropped here, and those of finished operations); a rendezvous under way drops its store itself


class GlooTransport(Transport):
    """Gloo channels. `host` must be this node's IP as the peer can reach it (never 0.0.0.0)."""

    def __init__(self, host: str, timeout_s: float = 30.0):
        super().__init__()
        assert host and host != "0.0.0.0", "give the node IP the peer connects to"
        self.host = host
        self.timeout_s = timeout_s

    def listen(self, peer: str) -> GlooAddress:
        """Host a new channel to `peer` (rank 0) and return the address it must `connect` to: (host,
        port, the pair's secret). Hand it to `peer` only over an authenticated path (a Ray call).

        Replaces any existing channel to `peer`; the group forms in the background once it joins.
        """
        store = _master_store(self.host, self.timeout_s)
        port = store.port
        secret = secrets.token_bytes(32)
        ch = GlooChannel(peer, 0, store, self.timeout_s, secret)
        del store  # the channel holds it until the group is formed
        threading.Thread(target=ch._rendezvous, args=(self.host,), daemon=True,
                         name=f"gloo-listen-{peer}").start()
        self._add(ch)
        return GlooAddress(self.host, port, secret)

    def connect(self, peer: str, address: GlooAddress) -> None:
        """Join the channel `peer` is hosting at `address` (`listen`'s), as rank 1; blocks until it
        is formed."""
        host, port, secret = address
        try:
            store = dist.TCPStore(host, port, 2, False, timeout=_td(self.timeout_s))
        except Exception as e:
            raise _typed(e, f"connect to {peer!r} at {host}:{port}") from e
        ch = GlooChannel(peer, 1, store, self.timeout_s, secret)
        del store
        ch._rendezvous(self.host)
        ch._group()
        self._add(ch)
