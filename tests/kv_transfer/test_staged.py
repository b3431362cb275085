"""Which backend a pair of KV caches gets (kv_transfer.factory), and the staged gloo channel that carries
a GPU cache's KV through host memory when both workers share one GPU (kv_transfer.staged).

Without a GPU: the choice from fake device ids, and the staging copies on CPU tensors (a `StagedTransport`
for device "cpu" copies every tensor exactly as one for a GPU copies device tensors), over real gloo
sockets against a plain gloo peer (the wire is the same). With a GPU (`gpu`): two engines on ONE device
hand over KV through pinned host memory, and the decode side's text equals one engine's."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kv_transfer import KVLayout, LeaseTable
from kv_transfer.factory import DeviceTransport, PairAddress, TransportKind, choose_transport, make_transport
from kv_transfer.gloo import GlooTransport
from kv_transfer.protocol import recv_kv, send_kv
from kv_transfer.staged import StagedChannel, StagedTransport

HOST = "127.0.0.1"


@pytest.mark.parametrize("device_type, mine, peer, kind", [
    ("cpu", None, None, TransportKind.GLOO),
    ("cpu", None, "GPU-aaaa", TransportKind.GLOO),  # a CPU cache speaks plain gloo to anyone
    ("cuda", "GPU-aaaa", "GPU-bbbb", TransportKind.NCCL),  # two GPUs: NCCL
    ("cuda", "GPU-aaaa", "GPU-aaaa", TransportKind.STAGED),  # one GPU: NCCL cannot pair the ranks
    ("cuda", "GPU-aaaa", None, TransportKind.STAGED),  # a CPU peer: gloo, staged on this side
])
def test_the_pair_of_devices_chooses_the_backend(device_type, mine, peer, kind):
    assert choose_transport(device_type, mine, peer) is kind


def test_a_device_without_a_transport_is_refused():
    with pytest.raises(ValueError, match="device type 'meta'"):
        make_transport("meta", HOST)


def _pair(exporter, importer, peer_device=None):
    """Open exporter -> importer (listen on one side, connect on the other, as kv_endpoint does)."""
    importer.connect("P", exporter.listen("D", peer_device) if isinstance(exporter, DeviceTransport)
                     else exporter.listen("D"))


def test_cpu_caches_pair_over_plain_gloo_and_drop_forgets_the_channel_everywhere():
    exporter, importer = make_transport("cpu", HOST, 10), make_transport("cpu", HOST, 10)
    try:
        address = exporter.listen("D")
        assert isinstance(address, PairAddress) and address.wire == "gloo"
        importer.connect("P", address)
        assert exporter.kind_of("D") is importer.kind_of("P") is TransportKind.GLOO
        x = torch.arange(6, dtype=torch.float32)
        got = torch.zeros(6)
        r = importer.channel("P").irecv(got)
        exporter.channel("D").isend(x).wait(10)
        r.wait(10)
        assert torch.equal(got, x)
        exporter.drop("D")
        assert not exporter.has_channel("D") and exporter.kind_of("D") is None
        assert not exporter._backend(TransportKind.GLOO).has_channel("D")  # its store is not kept alive
    finally:
        exporter.close()
        importer.close()


def test_staged_send_takes_a_copy_and_receive_lands_only_on_wait():
    staged, plain = StagedTransport(HOST, "cpu", 10), GlooTransport(HOST, 10)
    try:
        plain.connect("P", staged.listen("D"))
        ch = staged.channel("D")
        assert isinstance(ch, StagedChannel) and not ch.pin  # pinned memory on CUDA only
        src = torch.arange(1000, dtype=torch.int64)
        landed = torch.zeros(1000, dtype=torch.int64)
        r = plain.channel("P").irecv(landed, 3)
        s = ch.isend(src, 3)
        src.fill_(-1)  # the caller may reuse its tensor once isend returns: the copy went out
        s.wait(10)
        r.wait(10)
        assert torch.equal(landed, torch.arange(1000))

        back = torch.full((1000,), 7, dtype=torch.int64)
        r = ch.irecv(back, 4)
        plain.channel("P").isend(torch.arange(1000) * 2, 4).wait(10)
        deadline = time.monotonic() + 10
        while int(r.host[-1]) != 1998:  # the bytes arrive in the host buffer (gloo's own thread)...
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert bool((back == 7).all())  # ...and reach the target only in `wait`, on the caller's side
        r.wait(10)
        assert torch.equal(back, torch.arange(1000) * 2)
    finally:
        staged.close()
        plain.close()


def test_a_broken_inner_channel_breaks_the_staged_one_for_good():
    staged, plain = StagedTransport(HOST, "cpu", 10), GlooTransport(HOST, 10)
    try:
        plain.connect("P", staged.listen("D"))
        ch = staged.channel("D")
        ch.inner.broken = True
        assert ch.broken and not staged.has_channel("D")
        ch.broken = False  # sticky: nothing revives a failed gloo channel
        assert ch.broken
        staged.drop("D", ch)
        assert not staged._gloo.has_channel("D")
    finally:
        staged.close()
        plain.close()


@pytest.mark.parametrize("staged_side", ["sender", "receiver"])
@pytest.mark.parametrize("src_ids, dst_ids", [([4, 5, 6], [10, 11, 12]), ([6, 2, 9], [12, 1, 5])])
def test_the_kv_protocol_runs_over_a_staged_channel_against_plain_gloo(staged_side, src_ids, dst_ids):
    """Header, chunks (zero copy from / into a run of blocks, or packed) and ack: the same bytes arrive
    when either side stages, so the staged wire is the plain gloo wire."""
    torch.manual_seed(0)
    src = torch.randn(16, 3, 2, 4, 2, 5).to(torch.bfloat16)  # [blocks, layers, K/V, block, kv heads, head dim]
    dst = torch.zeros(14, 3, 2, 4, 2, 5, dtype=src.dtype)
    handle = LeaseTable("P", KVLayout.of(src), lambda rid: None).grant("r", src_ids, num_tokens=10, first_token=1)
    staged, plain = StagedTransport(HOST, "cpu", 10), GlooTransport(HOST, 10)
    tp, td = (staged, plain) if staged_side == "sender" else (plain, staged)
    try:
        td.connect("P", tp.listen("D"))
        with ThreadPoolExecutor(1) as pool:
            push = pool.submit(send_kv, tp.channel("D"), src, handle, 10, group_bytes=500)
            recv_kv(td.channel("P"), dst, handle, dst_ids, 10, group_bytes=500)
            push.result(10)
    finally:
        tp.close()
        td.close()
    assert torch.equal(dst[dst_ids], src[src_ids])
    assert not dst[[b for b in range(14) if b not in dst_ids]].any()


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_two_caches_on_one_gpu_get_the_staged_backend():
    exporter, importer = make_transport("cuda", HOST, 30), make_transport("cuda", HOST, 30)
    try:
        assert exporter.device_id == importer.device_id and exporter.device_id.startswith("GPU-")
        _pair(exporter, importer, importer.device_id)
        assert exporter.kind_of("D") is importer.kind_of("P") is TransportKind.STAGED
        assert exporter.channel("D").pin
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        got = torch.zeros_like(x)
        r = importer.channel("P").irecv(got)
        exporter.channel("D").isend(x).wait(30)
        r.wait(30)
        assert torch.equal(got, x)
    finally:
        exporter.close()
        importer.close()


@pytest.mark.gpu
def test_prefill_and_decode_engines_on_one_gpu_hand_over_kv_through_host_memory(smollm2_or_tiny):
    """Both pools on one GPU, without Ray: a prefill engine's KV moves to a decode engine on the same
    device through the staged channel, and the decode side's greedy text is one engine's."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.kv_lending import KVLending
    from kv_transfer import KVReceiver, KVSender

    params = SamplingParams(max_tokens=16, temperature=0)
    config = EngineConfig(model=smollm2_or_tiny, device="cuda", num_kv_blocks=128, block_size=16)
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prompts = ["What is the capital of France?", "Name three prime numbers.", "Say hello in Spanish."]
    ids = [prefill.encode_prompt(p) for p in prompts]
    for i, p in enumerate(ids):
        decode.add_request(f"ref{i}", p, params)
    want = {}
    while decode.has_unfinished_requests():
        want.update({o.request_id: o.token_ids for o in decode.step() if o.finished})
    tp, td = make_transport("cuda", HOST, 60), make_transport("cuda", HOST, 60)
    try:
        _pair(tp, td, td.device_id)
        assert tp.kind_of("D") is TransportKind.STAGED
        leases = LeaseTable("P", KVLayout.of(prefill.runner.kv_cache), KVLending(prefill).release_prefilled)
        sender = KVSender(tp, prefill.runner.kv_cache, leases, 60)
        receiver = KVReceiver(td, decode.runner.kv_cache, lambda n: KVLending(decode).allocate_blocks(n, contiguous=True),
                              KVLending(decode).free_blocks, 60)
        for i, p in enumerate(ids):
            prefill.add_request(f"r{i}", p, params, prefill_only=True)
        outs = []
        while prefill.has_unfinished_requests():
            outs += [o for o in prefill.step() if o.finished]
        pushes = []
        with ThreadPoolExecutor(1) as pool:
            for out in outs:
                prompt = ids[int(out.request_id[1:])]
                handle = leases.grant(out.request_id, out.block_ids, len(prompt), out.token_ids[0])
                block_ids = receiver.receive(handle, lambda h=handle: pushes.append(pool.submit(sender.push, h, "D")))
                pushes[-1].result(60)
                KVLending(decode).add_prefilled_request(out.request_id, prompt, [handle.first_token], params, block_ids,
                                             handle.num_tokens)
        got = {}
        while decode.has_unfinished_requests():
            got.update({o.request_id: o.token_ids for o in decode.step() if o.finished})
        assert [got[f"r{i}"] for i in range(len(ids))] == [want[f"ref{i}"] for i in range(len(ids))]
        assert sender.num_sent == len(ids) and receiver.num_failed == 0
    finally:
        tp.close()
        td.close()


@pytest.mark.gpu
def test_both_pools_on_one_gpu_under_ray_pair_over_the_staged_channel(smollm2_or_tiny):
    """The serving path: a prefill and a decode actor sharing one GPU (`worker_num_gpus: 0.5`); the
    decode actor sends its device id along, the prefill actor picks staged gloo, greedy text as one engine."""
    ray = pytest.importorskip("ray")
    from test_nccl import NUM_BLOCKS, PROMPTS, _actors

    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        Prefill, Decode = _actors()
        prefill, decode = Prefill.options(num_gpus=0.5).remote("p0", smollm2_or_tiny), \
            Decode.options(num_gpus=0.5).remote("d0", smollm2_or_tiny)
        ref = ray.get(decode.run.remote(PROMPTS), timeout=300)
        prefilled = ray.get([prefill.prefill.remote(f"r{i}", p) for i, p in enumerate(PROMPTS)], timeout=300)
        ray.get([decode.pull.remote(h, ids, prefill) for h, ids in prefilled], timeout=300)
        assert ray.get(prefill.transport.remote("d0")) == "staged"
        done = ray.get(decode.run.remote(), timeout=300)
        assert [done[f"r{i}"] for i in range(len(PROMPTS))] == [ref[f"ref{i}"] for i in range(len(PROMPTS))]
        assert ray.get(decode.integrity.remote()) == NUM_BLOCKS
    finally:
        ray.shutdown()
