"""KV transfer between engines of different tensor-parallel degrees (no Ray): a prefill engine with TP p
hands its KV to a decode engine with TP d, for (p, d) in (1, 2), (2, 1), (2, 2), over the in-process
transport. Rank 0 of a TP side gathers every KV head from its followers (or scatters them to them:
engine.parallel.kv_shards); full-head blocks travel. Greedy output equals the single engine, token
for token, and both sides' block pools are whole afterwards (leases ended, nothing leaked).

The follower ranks run as threads of this process (`run_follower`): over gloo on localhost, and (marked
`gpu`, with two GPUs or more: scripts/gpu_check.sh's "tp" part) over NCCL, rank r on GPU r."""

from __future__ import annotations

import dataclasses
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_lending import KVLending
from engine.parallel import TPGroup, leader_store, run_follower
from engine.parallel.kv_shards import full_kv_heads, gather_kv, scatter_kv
from kv_transfer import InProcHub, InProcTransport, KVLayout, KVReceiver, KVSender, LeaseTable

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[1 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([3, 5, 9, 16, 17, 30])]
BASE = dict(dtype="float32", num_kv_blocks=64, block_size=4, num_threads=1)


class Side:
    """An engine of `tp` ranks (followers as threads), with its KV wiring as a worker has it."""

    def __init__(self, path: str, tp: int, name: str, device: str = "cpu"):
        # CUDA: rank r on GPU r (run_follower's rank_device), rank 0 on GPU 0; an NCCL group.
        config = EngineConfig(model=path, tensor_parallel_size=tp, device=device, **BASE)
        self.threads: list[threading.Thread] = []
        if tp == 1:
            self.engine = LLMEngine(config)
        else:
            store, init = leader_store(tp)
            self.threads = [threading.Thread(target=run_follower, args=(config, r, tp, init, 30.0), daemon=True,
                                             name=f"{name}-rank{r}") for r in range(1, tp)]
            for t in self.threads:
                t.start()
            rank0 = "cuda:0" if device == "cuda" else device
            self.engine = LLMEngine(config, tp_group=TPGroup.connect(0, tp, init, rank0, 30.0, store=store))
        runner = self.engine.runner
        layout = KVLayout.of(runner.kv_cache)
        self.sharded = tp > 1
        if self.sharded:
            layout = dataclasses.replace(layout, num_kv_heads=full_kv_heads(runner.config))
        self.layout = layout
        self.lending = KVLending(self.engine)

    def sender(self, transport) -> tuple[KVSender, LeaseTable]:
        leases = LeaseTable("P", self.layout, self.lending.release_prefilled, 30.0)
        gather = functools.partial(gather_kv, self.engine.runner) if self.sharded else None
        return KVSender(transport, self.engine.runner.kv_cache, leases, 5.0, gather=gather), leases

    def receiver(self, transport) -> KVReceiver:
        shards = dict(layout=self.layout, scatter=functools.partial(scatter_kv, self.engine.runner)) \
            if self.sharded else {}
        return KVReceiver(transport, self.engine.runner.kv_cache, self.lending.allocate_blocks,
                          self.lending.free_blocks, 5.0, **shards)

    def close(self) -> None:
        self.engine.close()
        for t in self.threads:
            t.join(30)
            assert not t.is_alive()


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")  # 4 heads, 2 KV heads: TP 2 holds one KV head per rank


def _single_engine(model_dir: str, device: str) -> dict[str, list[int]]:
    eng = LLMEngine(EngineConfig(model=model_dir, device=device, **BASE))
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, PARAMS)
    return _run(eng)


@pytest.fixture(scope="module")
def reference(model_dir):
    return _single_engine(model_dir, "cpu")


# (2, 2) gathers and scatters both: the default suite's case; the others are slow.
@pytest.mark.parametrize("p_tp, d_tp", [pytest.param(1, 2, marks=pytest.mark.slow),
                                        pytest.param(2, 1, marks=pytest.mark.slow), (2, 2)])
def test_kv_moves_between_tp_degrees_and_decodes_the_same_tokens(model_dir, reference, p_tp, d_tp):
    _move_and_decode(model_dir, reference, p_tp, d_tp, "cpu")


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_num_gpus() < 2, reason=f"TP on CUDA needs >= 2 GPUs, one a rank (found {_num_gpus()})")
@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (2, 2)])
def test_kv_moves_between_tp_degrees_on_gpus(model_dir, p_tp, d_tp):
    """The same on CUDA: each TP side an NCCL group over GPUs 0 and 1 (both sides share the two GPUs),
    the gather and scatter NCCL collectives, the blocks between the two rank 0s on GPU 0; equal to the
    single engine on GPU 0, fp32."""
    _move_and_decode(model_dir, _single_engine(model_dir, "cuda"), p_tp, d_tp, "cuda")


def _move_and_decode(model_dir, reference, p_tp, d_tp, device):
    p, d = Side(model_dir, p_tp, "P", device), Side(model_dir, d_tp, "D", device)
    try:
        pad = d.lending.allocate_blocks(12)  # the decode side's block ids differ from the sender's
        hub = InProcHub()
        tp_, td = InProcTransport(hub, "P"), InProcTransport(hub, "D")
        tp_.connect("D")
        td.connect("P")
        sender, leases = p.sender(tp_)
        receiver = d.receiver(td)
        pushes = []
        with ThreadPoolExecutor(2) as pool:
            for i, prompt in enumerate(PROMPTS):
                rid = f"r{i}"
                p.engine.add_request(rid, prompt, PARAMS, prefill_only=True)
                out = None
                while out is None:
                    out = next((o for o in p.engine.step() if o.request_id == rid and o.finished), None)
                assert out.finish_reason == "prefilled"
                h = leases.grant(rid, out.block_ids, len(prompt), out.token_ids[0])
                ids = receiver.receive(h, lambda h=h: pushes.append(pool.submit(sender.push, h, "D")))
                d.lending.add_prefilled_request(rid, prompt, [h.first_token], PARAMS, ids, len(prompt))
            for f in pushes:
                f.result(timeout=10)
        assert _run(d.engine) == reference
        assert len(leases) == 0 and sender.num_sent == len(PROMPTS)
        d.lending.free_blocks(pad)
        for side in (p, d):
            side.engine.check_integrity()
            assert side.engine.block_manager.num_used_blocks == 0
    finally:
        p.close()
        d.close()
