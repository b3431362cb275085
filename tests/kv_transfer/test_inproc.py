"""Full protocol over the in-process transport between two tiny engines (no Ray, no sockets)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_lending import KVLending
from kv_transfer import (EpochMismatchError, InProcHub, InProcTransport, KVLayout, KVReceiver, KVSender,
                         LeaseExpiredError, LeaseTable, PeerDiedError, ReceiverOutOfBlocksError,
                         TransferTimeoutError)
from kv_transfer.gloo import GlooTransport
from kv_transfer.protocol import recv_kv, send_kv

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[1 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([3, 4, 5, 9, 16, 17, 30])]


class Pair:
    """Prefill engine P and decode engine D joined by in-process channels."""

    def __init__(self, model_dir: str, lease_s: float = 30.0, kv_cache_dtype: str = "auto"):
        self.p = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, block_size=4, num_threads=1,
                                        kv_cache_dtype=kv_cache_dtype))
        self.d = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=48, block_size=4, num_threads=1,
                                        kv_cache_dtype=kv_cache_dtype))
        self.d_pad = KVLending(self.d).allocate_blocks(12)  # so the decode side's block ids differ from the sender's
        hub = InProcHub()
        self.hub = hub
        tp, td = InProcTransport(hub, "P"), InProcTransport(hub, "D")
        tp.connect("D")
        td.connect("P")
        self.leases = LeaseTable("P", KVLayout.of(self.p.runner.kv_cache), KVLending(self.p).release_prefilled, lease_s)
        self.sender = KVSender(tp, self.p.runner.kv_cache, self.leases, timeout_s=5)
        self.receiver = KVReceiver(td, self.d.runner.kv_cache, KVLending(self.d).allocate_blocks, KVLending(self.d).free_blocks, timeout_s=5)
        self.pool = ThreadPoolExecutor(4)
        self.pushes = []

    def prefill(self, rid: str, prompt: list[int]):
        self.p.add_request(rid, prompt, PARAMS, prefill_only=True)
        while True:
            for out in self.p.step():
                if out.request_id == rid and out.finished:
                    assert out.finish_reason == "prefilled"
                    return self.leases.grant(rid, out.block_ids, len(prompt), out.token_ids[0])

    def start_push(self, handle):
        return lambda: self.pushes.append(self.pool.submit(self.sender.push, handle, "D"))

    def check(self):
        for f in self.pushes:
            f.exception(timeout=10)  # every push has finished, one way or the other
        self.p.check_integrity()
        self.d.check_integrity()
        assert self.p.block_manager.num_free_blocks == 64
        assert self.d.block_manager.num_free_blocks == 48 - len(self.d_pad)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def _single_engine(model_dir: str, kv_cache_dtype: str = "auto") -> dict[str, list[int]]:
    eng = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=128, block_size=4, num_threads=1,
                                 kv_cache_dtype=kv_cache_dtype))
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, PARAMS)
    return _run(eng)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    return _single_engine(model_dir)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8_e5m2"])
def test_transfer_then_decode_matches_single_engine(model_dir, reference, kv_cache_dtype):
    """Disaggregated (prefill on P, KV moved, decode on D) equals one engine, for any KV element type."""
    pair = Pair(model_dir, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype != "auto":
        reference = _single_engine(model_dir, kv_cache_dtype)
    for i, prompt in enumerate(PROMPTS):
        h = pair.prefill(f"r{i}", prompt)
        ids = pair.receiver.receive(h, pair.start_push(h))
        assert len(ids) == h.num_blocks
        KVLending(pair.d).add_prefilled_request(f"r{i}", prompt, [h.first_token], PARAMS, ids, len(prompt))
    assert _run(pair.d) == reference
    assert len(pair.leases) == 0 and pair.sender.num_sent == len(PROMPTS)
    pair.check()


def test_concurrent_transfers_share_the_channel(model_dir, reference):
    pair = Pair(model_dir)
    handles = [pair.prefill(f"r{i}", p) for i, p in enumerate(PROMPTS[:5])]
    with ThreadPoolExecutor(5) as ex:
        futs = [ex.submit(pair.receiver.receive, h, pair.start_push(h)) for h in handles]
        ids = [f.result(timeout=20) for f in futs]
    for h, b, p in zip(handles, ids, PROMPTS):
        KVLending(pair.d).add_prefilled_request(h.request_id, p, [h.first_token], PARAMS, b, len(p))
    assert _run(pair.d) == {f"r{i}": reference[f"r{i}"] for i in range(5)}
    pair.check()


def test_expired_lease_frees_both_sides(model_dir):
    pair = Pair(model_dir, lease_s=0.05)
    h = pair.prefill("r0", PROMPTS[3])
    import time
    time.sleep(0.1)
    with pytest.raises(LeaseExpiredError):  # the sender judges it on its own clock; both sides free
        pair.receiver.receive(h, pair.start_push(h), abandon=lambda: pair.leases.release(h.request_id, h.epoch))
    pair.check()


def test_sender_refuses_expired_lease(model_dir):
    pair = Pair(model_dir)
    h = pair.prefill("r0", PROMPTS[3])
    pair.leases.reap_expired(now=h.expires_at)  # the sender's clock ran out first
    with pytest.raises(LeaseExpiredError):
        pair.receiver.receive(h, pair.start_push(h))
    pair.check()


def test_superseded_epoch_is_refused(model_dir):
    pair = Pair(model_dir)
    old = pair.prefill("r0", PROMPTS[3])
    new = pair.leases.grant("r0", list(old.block_ids), old.num_tokens, old.first_token)
    with pytest.raises(EpochMismatchError):
        pair.receiver.receive(old, pair.start_push(old))
    assert "r0" in pair.leases  # the newer grant still holds the blocks...
    ids = pair.receiver.receive(new, pair.start_push(new))  # ...and can still be fetched
    assert pair.d.block_manager.num_free_blocks == 48 - len(pair.d_pad) - new.num_blocks
    KVLending(pair.d).free_blocks(ids)
    pair.check()


def test_receiver_out_of_blocks(model_dir):
    pair = Pair(model_dir)
    h = pair.prefill("r0", PROMPTS[6])  # 30 tokens = 8 blocks
    hog = KVLending(pair.d).allocate_blocks(4 * pair.d.block_manager.num_free_blocks - 4)
    abandoned = []
    with pytest.raises(ReceiverOutOfBlocksError):
        pair.receiver.receive(h, pair.start_push(h),
                              abandon=lambda: abandoned.append(pair.leases.release(h.request_id, h.epoch)))
    assert abandoned == [True]
    KVLending(pair.d).free_blocks(hog)
    pair.check()


def test_sender_never_pushes_times_out(model_dir):
    pair = Pair(model_dir)
    h = pair.prefill("r0", PROMPTS[3])
    with pytest.raises(TransferTimeoutError):
        pair.receiver.receive(h, lambda: None, timeout_s=0.2)
    pair.leases.reap_expired(now=h.expires_at)  # the lease is the sender's backstop
    pair.check()


def test_peer_dies_mid_transfer(model_dir):
    pair = Pair(model_dir)
    h = pair.prefill("r0", PROMPTS[3])
    threading.Timer(0.1, pair.hub.kill, args=("P",)).start()
    with pytest.raises(PeerDiedError):
        pair.receiver.receive(h, lambda: None, timeout_s=5)
    pair.leases.reap_expired(now=h.expires_at)
    pair.check()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e5m2"])  # the cache's elements (kv_cache_dtype)
@pytest.mark.parametrize("backend", ["inproc", "gloo"])
@pytest.mark.parametrize("src_ids,dst_ids", [
    ([4, 5, 6], [10, 11, 12]),  # both runs: zero copy on both sides
    ([6, 2, 9], [10, 11, 12]),  # sender packs, receiver lands in place
    ([4, 5, 6], [3, 0, 7]),  # sender sends from its cache, receiver stages and scatters
    ([6, 2, 9], [12, 1, 5]),  # both copy
])
def test_blocks_arrive_intact_with_or_without_copies(src_ids, dst_ids, backend, dtype):
    """Each side alone chooses zero copy (its ids are one run) or pack/stage; the bytes agree either way,
    also over real gloo sockets (two channels in this one process), where every chunk has its own tag."""
    torch.manual_seed(0)
    src = torch.randn(16, 3, 2, 4, 2, 5).to(getattr(torch, dtype))  # [blocks, layers, K/V, block size, kv heads, head dim]
    dst = torch.zeros(14, 3, 2, 4, 2, 5, dtype=src.dtype)
    layout = KVLayout.of(src)
    leases = LeaseTable("P", layout, lambda rid: None)
    handle = leases.grant("r", src_ids, num_tokens=10, first_token=1)
    if backend == "inproc":
        hub = InProcHub()
        tp, td = InProcTransport(hub, "P"), InProcTransport(hub, "D")
        tp.connect("D")
        td.connect("P")
    else:
        tp, td = GlooTransport("127.0.0.1", timeout_s=10), GlooTransport("127.0.0.1", timeout_s=10)
        td.connect("P", tp.listen("D"))
    try:
        with ThreadPoolExecutor(1) as pool:
            # group_bytes small enough that the staged paths run in several layer groups
            push = pool.submit(send_kv, tp.channel("D"), src, handle, 5, group_bytes=500)
            recv_kv(td.channel("P"), dst, handle, dst_ids, 5, group_bytes=500)
            push.result(5)
    finally:
        tp.close()
        td.close()
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 - fp8 has no torch.equal
    assert torch.equal(as_bytes(dst[dst_ids]), as_bytes(src[src_ids]))
    untouched = [b for b in range(14) if b not in dst_ids]
    assert not as_bytes(dst[untouched]).any()
