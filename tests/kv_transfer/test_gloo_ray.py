"""Gloo transfers between two Ray actors on the real SmolLM2: prefill on one, decode on the other."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import ray

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_lending import KVLending
from helpers import local_ray
from kv_transfer import EpochMismatchError, LeaseExpiredError, PeerDiedError, ProtocolError

# Ray workers cannot import this test module: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARAMS = SamplingParams(max_tokens=16, temperature=0)
WORDS = "the quick brown fox jumps over a lazy dog while seven small robots count prime numbers".split()
PROMPTS = [" ".join(WORDS[j % len(WORDS)] for j in range(n)) for n in (3, 7, 12, 16, 21, 30, 47, 70)]


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=None, num_threads=1, num_kv_blocks=128, block_size=16))


@ray.remote(num_cpus=1, max_concurrency=8)
class Prefill:
    def __init__(self, worker_id: str, lease_s: float = 30.0, push_delay_s: float = 0.0):
        from deployments.cluster.kv_endpoint import KVExporter

        self.lock = threading.RLock()
        self.engine = _engine()
        self.kv_exporter = KVExporter(worker_id, self.engine, engine_lock=self.lock, lease_s=lease_s,
                                      timeout_s=20, host="127.0.0.1")
        self.push_delay_s = push_delay_s

    def prefill(self, rid: str, prompt: str, lease_s: float | None = None):
        with self.lock:
            ids = self.engine.encode_prompt(prompt)
            self.engine.add_request(rid, ids, PARAMS, prefill_only=True)
            while True:
                for out in self.engine.step():
                    if out.request_id == rid and out.finished:
                        assert out.finish_reason == "prefilled", out.finish_reason
                        return self.kv_exporter.grant(out, len(ids), lease_s), ids

    def regrant(self, handle):
        return self.kv_exporter.leases.grant(handle.request_id, list(handle.block_ids), handle.num_tokens,
                                             handle.first_token)

    def reap(self, now=None):
        return self.kv_exporter.leases.reap_expired(now)

    def integrity(self):
        with self.lock:
            self.engine.check_integrity()
            return self.engine.block_manager.num_free_blocks, len(self.kv_exporter.leases)

    # KVExportMixin's methods, with an optional delay before pushing to let a test kill us mid-transfer.
    def kv_open_channel(self, peer_id):
        return self.kv_exporter.open_channel(peer_id)

    def kv_push(self, handle, peer_id):
        time.sleep(self.push_delay_s)
        self.kv_exporter.push(handle, peer_id)

    def kv_release(self, request_id, epoch):
        return self.kv_exporter.release(request_id, epoch)

    def kv_probe(self, peer_id, nbytes):
        return self.kv_exporter.probe(peer_id, nbytes)

    def corrupt_headers(self, peer_id):
        """Fault injection: each KV header sent to `peer_id` from now on has a field changed after its
        checksum was computed (as a corrupting wire would)."""
        import torch

        from kv_transfer.protocol import HEADER_LEN

        channel = self.kv_exporter.transport.channel(peer_id)
        real = channel.isend

        def isend(tensor, tag=0):
            if tag == 0 and tensor.dtype == torch.int64 and tensor.numel() == HEADER_LEN:
                tensor = tensor.clone()
                tensor[5] += 1
            return real(tensor, tag)
        channel.isend = isend


@ray.remote(num_cpus=1, max_concurrency=8)
class Decode:
    def __init__(self, worker_id: str):
        from deployments.cluster.kv_endpoint import KVImporter

        self.lock = threading.RLock()
        self.engine = _engine()
        self.kv_importer = KVImporter(worker_id, self.engine, engine_lock=self.lock, timeout_s=20, host="127.0.0.1")

    def pull(self, handle, prompt_ids, exporter, timeout_s=None):
        block_ids = self.kv_importer.pull(handle, exporter, timeout_s)
        with self.lock:
            KVLending(self.engine).add_prefilled_request(handle.request_id, prompt_ids, [handle.first_token], PARAMS,
                                              block_ids, handle.num_tokens)
        return len(block_ids)

    def pairs(self):
        return self.kv_importer.pairs.snapshot()

    def run(self):
        done = {}
        with self.lock:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out.token_ids
        return done

    def integrity(self):
        with self.lock:
            self.engine.check_integrity()
            return self.engine.block_manager.num_free_blocks

    def reference(self, prompts):
        with self.lock:
            for i, p in enumerate(prompts):
                self.engine.add_request(f"ref{i}", p, PARAMS)
        return self.run()


def _settles(get, want, timeout_s=10.0):
    """The exporter frees its blocks on the receiver's ack, just after the pull returns."""
    deadline = time.monotonic() + timeout_s
    while (got := get()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


@pytest.fixture(scope="module")
def cluster():
    with local_ray(4):
        yield


@pytest.fixture(scope="module")
def decode(cluster):
    return Decode.remote("d0")


@pytest.fixture(scope="module")
def prefill(cluster):
    return Prefill.remote("p0")


@pytest.fixture(scope="module")
def reference(decode):
    done = ray.get(decode.reference.remote(PROMPTS))
    return [done[f"ref{i}"] for i in range(len(PROMPTS))]


def test_disaggregated_matches_single_engine(prefill, decode, reference):
    prefilled = ray.get([prefill.prefill.remote(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    # all pulls in flight at once over the one channel (the first also opens it)
    ray.get([decode.pull.remote(h, ids, prefill) for h, ids in prefilled], timeout=120)
    done = ray.get(decode.run.remote())
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert _settles(lambda: ray.get(prefill.integrity.remote()), (128, 0)) == (128, 0)
    assert ray.get(decode.integrity.remote()) == 128


def test_one_decoder_two_prefillers_at_once(prefill, decode, reference):
    other = Prefill.remote("p1")
    prefilled = ray.get([(prefill if i % 2 else other).prefill.remote(f"m{i}", p) for i, p in enumerate(PROMPTS)])
    ray.get([decode.pull.remote(h, ids, prefill if i % 2 else other) for i, (h, ids) in enumerate(prefilled)],
            timeout=120)
    done = ray.get(decode.run.remote())
    assert [done[f"m{i}"] for i in range(len(PROMPTS))] == reference
    both = lambda: ray.get([prefill.integrity.remote(), other.integrity.remote()])  # noqa: E731
    assert _settles(both, [(128, 0), (128, 0)]) == [(128, 0), (128, 0)]
    assert ray.get(decode.integrity.remote()) == 128
    ray.kill(other)


def test_expired_lease(cluster, decode):
    p = Prefill.remote("p-exp", lease_s=0.5)
    h, ids = ray.get(p.prefill.remote("e0", PROMPTS[4]))
    time.sleep(0.6)
    with pytest.raises(LeaseExpiredError):  # the prefill side answers: expired on its own clock
        ray.get(decode.pull.remote(h, ids, p))
    h, ids = ray.get(p.prefill.remote("e1", PROMPTS[4]))
    ray.get(p.reap.remote(h.expires_at))  # the exporter reaped it first
    with pytest.raises(LeaseExpiredError):
        ray.get(decode.pull.remote(h, ids, p))
    time.sleep(0.2)
    assert ray.get(p.integrity.remote()) == (128, 0)
    assert ray.get(decode.integrity.remote()) == 128
    ray.kill(p)


def test_epoch_mismatch(prefill, decode):
    old, ids = ray.get(prefill.prefill.remote("x0", PROMPTS[5]))
    new = ray.get(prefill.regrant.remote(old))
    with pytest.raises(EpochMismatchError):
        ray.get(decode.pull.remote(old, ids, prefill))
    assert ray.get(decode.integrity.remote()) == 128
    assert ray.get(decode.pull.remote(new, ids, prefill)) == new.num_blocks
    ray.get(decode.run.remote())
    assert _settles(lambda: ray.get(prefill.integrity.remote()), (128, 0)) == (128, 0)
    assert ray.get(decode.integrity.remote()) == 128


def test_sender_killed_mid_transfer(cluster, decode):
    p = Prefill.remote("p-kill", push_delay_s=1.0)
    h, ids = ray.get(p.prefill.remote("k0", PROMPTS[7]))
    ref = decode.pull.remote(h, ids, p, 10.0)
    time.sleep(0.5)  # the decode side is waiting for the header now
    ray.kill(p)
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError):
        ray.get(ref, timeout=30)
    assert time.monotonic() - t0 < 10
    assert ray.get(decode.integrity.remote()) == 128


def test_pair_book_counts_each_failure_by_cause(cluster, decode):
    """The decode side's book of KV pairs (kv_transfer/pair_stats.py): a probe measured when each channel
    opened, transfers and bytes, and failures by cause: leases that expired, a sender killed
    mid-transfer and a header corrupted on the wire, injected here on pairs of their own."""
    p = Prefill.remote("p-cause", lease_s=0.5)
    # NOTE: a lease long enough for the channel's opening and probe on a loaded host (0.5 s was not)
    h, ids = ray.get(p.prefill.remote("c0", PROMPTS[3], 30.0))
    assert ray.get(decode.pull.remote(h, ids, p)) == h.num_blocks  # opens (and probes) the channel
    ray.get(decode.run.remote())
    for i in (1, 2):
        h, ids = ray.get(p.prefill.remote(f"c{i}", PROMPTS[3]))
        time.sleep(0.6)
        with pytest.raises(LeaseExpiredError):
            ray.get(decode.pull.remote(h, ids, p))
    killed = Prefill.remote("p-cause-kill", push_delay_s=1.0)
    h2, ids2 = ray.get(killed.prefill.remote("c3", PROMPTS[7]))
    ray.get(decode.pull.remote(*ray.get(killed.prefill.remote("c4", PROMPTS[2])), killed))  # channel open
    ray.get(decode.run.remote())
    ref = decode.pull.remote(h2, ids2, killed, 10.0)
    time.sleep(0.5)
    ray.kill(killed)
    with pytest.raises(PeerDiedError):
        ray.get(ref, timeout=30)

    ray.get(p.corrupt_headers.remote("d0"))
    h5, ids5 = ray.get(p.prefill.remote("c5", PROMPTS[3], 30.0))
    with pytest.raises(ProtocolError, match="corrupted"):
        ray.get(decode.pull.remote(h5, ids5, p))

    pairs = ray.get(decode.pairs.remote())
    ok, gone = pairs["p-cause"], pairs["p-cause-kill"]
    assert ok["src"] == "p-cause" and ok["dst"] == "d0" and ok["transport"] == "gloo"
    assert ok["probe_gbps"] > 0 and ok["live_gbps"] > 0 and ok["num_opens"] == 1
    assert ok["num_transfers"] == 1 and ok["num_bytes"] == h.nbytes
    assert ok["failures"] == {"lease_expired": 2, "checksum": 1}
    assert ok["last_failure"] == "ProtocolError (checksum)"
    assert gone["failures"] == {"peer_gone": 1} and gone["num_transfers"] == 1
    assert gone["last_failure"] == "PeerDiedError (peer_gone)"
    assert ok["note"] is None  # CPU to CPU over gloo is all this hardware has
    assert ray.get(decode.integrity.remote()) == 128
    ray.kill(p)
