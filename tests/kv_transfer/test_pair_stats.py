"""The KV pair book (kv_transfer/pair_stats.py) without Ray: causes, the probe over a channel, the live
average, the one-time note of a pair slower than its hardware allows, and the listener."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from kv_transfer import (EpochMismatchError, InProcHub, InProcTransport, KVTransferError, LeaseExpiredError,
                         PeerDiedError, ProtocolError, TransferTimeoutError)
from kv_transfer.pair_stats import (LIVE_WEIGHT, FailureCause, PairBook, PostedProbe, cause_of, probe_send,
                                    slow_transport_note)


@pytest.mark.parametrize("exc, cause", [
    (TransferTimeoutError("t"), FailureCause.TIMEOUT), (PeerDiedError("p"), FailureCause.PEER_GONE),
    (LeaseExpiredError("l"), FailureCause.LEASE_EXPIRED), (EpochMismatchError("e"), FailureCause.LEASE_EXPIRED),
    (ProtocolError("c"), FailureCause.CHECKSUM), (KVTransferError("x"), FailureCause.OTHER)])
def test_each_transfer_error_has_its_cause(exc, cause):
    assert cause_of(exc) is cause


def test_probe_over_a_channel_measures_and_books_the_pair():
    hub = InProcHub()
    a, b = InProcTransport(hub, "P"), InProcTransport(hub, "D")
    a.connect("D")
    b.connect("P")
    cache = torch.zeros(4, 2, dtype=torch.float16)
    ch = b.channel("P")
    with ch.lock:
        posted = PostedProbe(ch, cache, 1 << 16)
        sender = threading.Thread(target=probe_send, args=(a.channel("D"), cache, 1 << 16, 5.0))
        sender.start()
        gbps = posted.wait(5.0)
    sender.join(5)
    assert gbps > 0 and posted.nbytes == 1 << 16

    heard = []

    class Listener:
        def opened(self, pair):
            heard.append(("opened", pair.probe_gbps))

        def transferred(self, pair, nbytes):
            heard.append(("transferred", nbytes))

        def failed(self, pair, cause):
            heard.append(("failed", cause.value))

    book = PairBook("D", Listener())
    book.opened("P", "inproc", gbps)
    book.transferred("P", 2_000_000, 0.001)  # 2 GB/s
    book.transferred("P", 1_000_000, 0.001)  # 1 GB/s
    book.failed("P", LeaseExpiredError("late"))
    book.failed("P", PeerDiedError("gone"))
    book.failed("P", PeerDiedError("gone again"))
    snap = book.snapshot()["P"]
    assert snap["transport"] == "inproc" and snap["src"] == "P" and snap["dst"] == "D"
    assert snap["num_transfers"] == 2 and snap["num_bytes"] == 3_000_000
    assert snap["live_gbps"] == pytest.approx((1 - LIVE_WEIGHT) * 2.0 + LIVE_WEIGHT * 1.0, rel=1e-3)
    assert snap["failures"] == {"lease_expired": 1, "peer_gone": 2}
    assert snap["last_failure"] == "PeerDiedError (peer_gone)"
    assert heard[0] == ("opened", gbps) and heard[1:3] == [("transferred", 2_000_000), ("transferred", 1_000_000)]
    assert [h for h in heard if h[0] == "failed"] == [("failed", "lease_expired"), ("failed", "peer_gone"),
                                                     ("failed", "peer_gone")]
    assert book.version == 6


def test_a_slower_transport_than_the_hardware_allows_is_logged_once(caplog):
    assert slow_transport_note("gloo", None, None, 0.5) is None  # CPU pairs: gloo is all there is
    assert slow_transport_note("staged", "GPU-a", None, 3.0) is None  # a GPU cache and a CPU one
    assert slow_transport_note("nccl", "GPU-a", "GPU-b", 40.0) is None
    assert "sockets" in slow_transport_note("nccl", "GPU-a", "GPU-b", 0.9)
    book = PairBook("D")
    with caplog.at_level(logging.WARNING, logger="kv_transfer.pair_stats"):
        for _ in range(3):  # the channel reopens after failures: still one line
            book.opened("P", "staged", 2.5, peer_device="GPU-a", my_device="GPU-a")
    lines = [r.getMessage() for r in caplog.records if "slower than its hardware allows" in r.getMessage()]
    assert len(lines) == 1 and "P -> D over staged" in lines[0]
    assert book.snapshot()["P"]["num_opens"] == 3 and "NCCL cannot pair" in book.snapshot()["P"]["note"]
