"""What a gloo channel leaves listening, read from the kernel (/proc/net/tcp{,6} and this process's
descriptors), without Ray: every listener binds the given address only (never every interface), the
rendezvous store's listener is gone once the pair has formed, and nothing of the channel listens
after it is closed. Transfers still work once the store is gone."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from kv_transfer import KVTransferError
from kv_transfer.gloo import JOINED_KEY, GlooTransport
from helpers import tcp_listeners

HOST = "127.0.0.1"


def _listeners() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket of this process in LISTEN state."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return {(addr, port) for addr, port, inode in tcp_listeners() if inode in inodes}


def _pair() -> tuple[GlooTransport, GlooTransport, int]:
    exporter, importer = GlooTransport(HOST, timeout_s=20), GlooTransport(HOST, timeout_s=20)
    address = exporter.listen("importer")
    importer.connect("exporter", address)
    return exporter, importer, address.port


def _send_one(exporter: GlooTransport, importer: GlooTransport) -> torch.Tensor:
    got = torch.zeros(8)
    t = threading.Thread(target=lambda: importer.recv(got, "exporter", 20))
    t.start()
    exporter.send(torch.arange(8, dtype=torch.float32), "importer", 20)
    t.join(30)
    return got


def _settle(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        gc.collect()
        time.sleep(0.05)


def test_a_channel_listens_on_its_address_only_and_the_store_goes_once_the_pair_formed():
    before = _listeners()
    exporter, importer, store_port = _pair()
    ch = exporter.channel("importer")
    assert _settle(lambda: not ch.listening)  # the rendezvous is over on rank 0 too
    mine = _listeners() - before
    assert mine, "the gloo devices listen while the channel is open"
    assert all(addr == HOST for addr, _ in mine), mine  # never 0.0.0.0 / ::
    assert store_port not in {port for _, port in mine}, "the rendezvous store still listens"
    assert torch.equal(_send_one(exporter, importer), torch.arange(8, dtype=torch.float32))
    exporter.close()
    importer.close()
    del ch
    assert _settle(lambda: not (_listeners() - before)), _listeners() - before


def test_dropping_a_channel_closes_its_sockets_and_a_new_pair_can_form():
    before = _listeners()
    exporter, importer, _ = _pair()
    exporter.drop("importer")
    importer.drop("exporter")
    assert not exporter.has_channel("importer") and not importer.has_channel("exporter")
    with pytest.raises(KVTransferError):
        exporter.channel("importer")
    assert _settle(lambda: not (_listeners() - before)), _listeners() - before
    exporter2, importer2, _ = _pair()  # a peer that comes back gets a fresh channel
    assert torch.equal(_send_one(exporter2, importer2), torch.arange(8, dtype=torch.float32))
    for t in (exporter, importer, exporter2, importer2):
        t.close()


def test_a_peer_that_never_joins_leaves_nothing_listening():
    before = _listeners()
    exporter = GlooTransport(HOST, timeout_s=1.0)
    exporter.listen("nobody")
    ch = exporter._channels["nobody"]
    assert _settle(lambda: not ch.listening, timeout_s=15)  # the rendezvous timed out and let go of its store
    assert ch.broken
    exporter.close()
    del ch
    assert _settle(lambda: not (_listeners() - before)), _listeners() - before


def test_nccl_sockets_are_pinned_to_the_interface_of_the_node_address(monkeypatch):
    """NCCL binds its unique-id root and bootstrap sockets on one interface: the one carrying the
    node's cluster address, unless the operator chose one (NCCL_SOCKET_IFNAME). No GPU needed."""
    from kv_transfer.nccl import interface_of, pin_interface

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.7") is None  # a documentation address no interface holds
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert pin_interface("127.0.0.1") == "=lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    assert pin_interface("127.0.0.1") == "eth1"  # the operator's choice stands


def test_a_stranger_who_joins_the_rendezvous_is_refused():
    """A neighbour who reaches the store (its port is no secret) and joins as rank 1 without the pair's
    secret: rank 0 refuses the address it wrote (unsigned), so no group forms and nothing is sent to it;
    the stranger never learns where rank 0's device listens (every value it reads is signed, and its
    own group never forms)."""
    import datetime

    import torch.distributed as dist

    exporter = GlooTransport(HOST, timeout_s=5)
    address = exporter.listen("importer")
    stranger_error: list[BaseException] = []
    stranger_got: list[torch.Tensor] = []

    def join():
        try:
            store = dist.TCPStore(address.host, address.port, 2, False, timeout=datetime.timedelta(seconds=5))
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=5)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            pg = dist.ProcessGroupGloo(dist.PrefixStore("pdserve-kv", store), 1, 2, opts)
            store.set(JOINED_KEY, b"1")  # everything a rank 1 does, but signing
            got = torch.zeros(8)
            pg.recv([got], 0, 0).wait()
            stranger_got.append(got)
        except BaseException as e:  # noqa: BLE001 - what the test checks
            stranger_error.append(e)

    t = threading.Thread(target=join, daemon=True)
    t.start()
    with pytest.raises(KVTransferError):
        exporter.send(torch.arange(8, dtype=torch.float32), "importer", 10)
    t.join(30)
    assert not t.is_alive() and stranger_error and not stranger_got, "the stranger's group formed"
    exporter.close()
    # A pair that knows the secret still forms and sends.
    exporter, importer, _ = _pair()
    try:
        assert torch.equal(_send_one(exporter, importer), torch.arange(8, dtype=torch.float32))
    finally:
        exporter.close()
        importer.close()
