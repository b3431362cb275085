"""LeaseTable: epochs, expiry, ack, reaping, pinning during a transfer."""

import pytest

from kv_transfer import EpochMismatchError, KVLayout, LeaseExpiredError, LeaseTable

LAYOUT = KVLayout(2, 2, 4, "float32", 4)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _table(lease_s=10.0):
    released, clock = [], Clock()
    return LeaseTable("p0", LAYOUT, released.append, lease_s=lease_s, clock=clock), released, clock


def test_grant_validate_ack():
    t, released, clock = _table()
    h = t.grant("r1", [5, 2], num_tokens=7, first_token=9)
    assert (h.worker_id, h.request_id, h.block_ids, h.num_tokens, h.first_token) == ("p0", "r1", (5, 2), 7, 9)
    assert h.expires_at == clock.now + 10.0
    assert t.validate("r1", h.epoch) == h
    assert t.ack("r1", h.epoch) and released == ["r1"]
    assert not t.ack("r1", h.epoch) and released == ["r1"]  # freed exactly once
    with pytest.raises(LeaseExpiredError):
        t.validate("r1", h.epoch)


def test_expiry_and_reap():
    t, released, clock = _table()
    h1 = t.grant("r1", [0], 3, 1)
    h2 = t.grant("r2", [1], 3, 1, lease_s=100.0)
    clock.now += 10.0
    with pytest.raises(LeaseExpiredError):
        t.validate("r1", h1.epoch)
    assert t.reap_expired() == ["r1"] and released == ["r1"]
    assert t.validate("r2", h2.epoch) == h2 and len(t) == 1


def test_regrant_supersedes_epoch():
    t, released, _ = _table()
    old = t.grant("r1", [0, 1], 5, 1)
    new = t.grant("r1", [0, 1], 5, 1)
    assert new.epoch > old.epoch
    with pytest.raises(EpochMismatchError):
        t.validate("r1", old.epoch)
    assert not t.release("r1", old.epoch)  # a stale handle cannot free the newer grant's blocks
    assert t.validate("r1", new.epoch) == new and released == []


def test_pinned_lease_survives_reaping_until_transfer_ends():
    t, released, clock = _table()
    h = t.grant("r1", [0], 2, 1)
    assert t.begin_transfer("r1", h.epoch) == h
    clock.now += 60
    assert t.reap_expired() == [] and released == []
    t.end_transfer("r1")
    assert t.reap_expired() == ["r1"] and released == ["r1"]


def test_grant_checks_block_count():
    t, _, _ = _table()
    with pytest.raises(AssertionError):
        t.grant("r1", [0], num_tokens=5, first_token=1)  # 5 tokens need 2 blocks of 4


def test_release_all():
    t, released, _ = _table()
    t.grant("a", [0], 1, 1)
    t.grant("b", [1], 1, 1)
    assert sorted(t.release_all()) == ["a", "b"] and sorted(released) == ["a", "b"] and len(t) == 0


def test_a_gone_peer_ends_the_leases_granted_for_it_alone():
    # A copy leased to one named worker (a KV backup, a cached prefix) is freed when that worker is
    # gone, not at expiry; leases for anyone, for other peers, or being sent stay.
    t, released, _ = _table()
    t.grant("open", [0], 1, 1)
    t.grant("mine", [1], 1, 1, peer="d0")
    other = t.grant("theirs", [2], 1, 1, peer="d1")
    sending = t.grant("sending", [3], 1, 1, peer="d0")
    t.begin_transfer("sending", sending.epoch)
    regrant = t.grant("mine", [1], 1, 1, peer="d0")  # a re-grant for the same peer supersedes the old
    assert t.release_peer("d0") == ["mine"] and released == ["mine"]
    assert "mine" not in t and not t.release("mine", regrant.epoch)
    assert t.validate("theirs", other.epoch) == other and "open" in t and "sending" in t
    t.end_transfer("sending")
    assert t.release_peer("d0") == ["sending"] and released == ["mine", "sending"]
