"""KV transfer throughput: this protocol vs a bare gloo send/recv between the same two Ray actors.

    .venv/bin/python benchmarks/kv_transfer_bench.py [--reps 15]

Rows: the KV of one 512-token SmolLM2 prompt (real prefill), and a 64 MiB payload (91 blocks leased
without a prefill). Both are timed in the decode actor from "ask the prefill actor to push" to "blocks
unpacked and acked"; the bare row posts one recv of the same bytes and asks the other actor (same Ray
call) to send them. Also: the 512-token transfer time as a share of that prompt's prefill time.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import ray
import torch

from deployments.cluster.kv_endpoint import KVExporter, KVExportMixin, KVImporter
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_lending import KVLending
from kv_transfer.gloo import GlooTransport

PARAMS = SamplingParams(max_tokens=1, temperature=0)
NUM_BLOCKS = 160  # 91 blocks of 720 KiB = 64 MiB, plus 32 for the 512-token prompt


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=None, num_threads=1, num_kv_blocks=NUM_BLOCKS, block_size=16))


def _is_run(ids) -> bool:
    return all(b == ids[0] + i for i, b in enumerate(ids))


class _BenchExporter(KVExporter):
    """Frees synthetic leases (blocks allocated without a prefill) with `free_blocks`."""

    synthetic: dict[str, list[int]] = {}

    def _release_blocks(self, request_id: str) -> None:
        blocks = self.synthetic.pop(request_id, None)
        if blocks is None:
            super()._release_blocks(request_id)
        else:
            KVLending(self._engine).free_blocks(blocks)


@ray.remote(num_cpus=1, max_concurrency=4)
class PrefillActor(KVExportMixin):
    def __init__(self):
        torch.set_num_threads(1)
        self.engine = _engine()
        self.kv_exporter = _BenchExporter("p0", self.engine, host=ray.util.get_node_ip_address())
        self.bare = GlooTransport(ray.util.get_node_ip_address())
        self.lock = threading.Lock()

    def prefill(self, rid: str, prompt_ids: list[int]):
        self.engine.add_request(rid, prompt_ids, PARAMS.__class__(max_tokens=2, temperature=0, ignore_eos=True),
                                prefill_only=True)
        t0 = time.perf_counter()
        while True:
            for out in self.engine.step():
                if out.finished:
                    return self.kv_exporter.grant(out, len(prompt_ids)), time.perf_counter() - t0

    def synthetic(self, rid: str, num_tokens: int, contiguous: bool = False):
        """A lease on `num_tokens` of random KV. `contiguous`: in one run of block ids, as a prefill-only
        request's first chunk is allocated (the sender then sends straight from the cache); else as the
        free list gives them, which after some churn is scattered (the sender packs them first)."""
        if contiguous:
            blocks = self.engine.block_manager.allocate_contiguous(-(-num_tokens // self.engine.config.block_size))
            assert blocks is not None, "no run of free blocks that long"
        else:
            blocks = KVLending(self.engine).allocate_blocks(num_tokens)
        cache = self.engine.runner.kv_cache
        cache[blocks] = torch.randn((len(blocks),) + cache.shape[1:], dtype=cache.dtype)
        self.kv_exporter.synthetic[rid] = blocks
        return self.kv_exporter.leases.grant(rid, blocks, num_tokens, 0)

    def bare_listen(self):
        return self.bare.listen("d0")

    def bare_send(self, nbytes: int):
        bufs = self.__dict__.setdefault("_bufs", {})  # one per size: fresh pages would cost more than the send
        buf = bufs.get(nbytes)
        if buf is None:
            bufs[nbytes] = buf = torch.ones(nbytes, dtype=torch.uint8)
        self.bare.send(buf, "d0", 30)

    def free_blocks(self):
        return self.engine.block_manager.num_free_blocks


@ray.remote(num_cpus=1, max_concurrency=4)
class DecodeActor:
    def __init__(self):
        torch.set_num_threads(1)
        self.engine = _engine()
        self.kv_importer = KVImporter("d0", self.engine, host=ray.util.get_node_ip_address())
        self.bare = GlooTransport(ray.util.get_node_ip_address())

    def pull(self, handle, exporter) -> float:
        t0 = time.perf_counter()
        blocks = self.kv_importer.pull(handle, exporter)
        dt = time.perf_counter() - t0
        # which side could skip its copy (its block ids are one run; see kv_transfer.protocol)
        self.__dict__.setdefault("_runs", {"sender": [], "receiver": []})
        self._runs["sender"].append(_is_run(handle.block_ids))
        self._runs["receiver"].append(_is_run(blocks))
        KVLending(self.engine).free_blocks(blocks)
        return dt

    def runs(self) -> dict[str, list[bool]]:
        return self._runs

    def bare_connect(self, host, port):
        self.bare.connect("p0", (host, port))

    def bare_recv(self, nbytes: int, exporter) -> float:
        bufs = self.__dict__.setdefault("_bufs", {})
        buf = bufs.get(nbytes)
        if buf is None:
            bufs[nbytes] = buf = torch.zeros(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        pending = self.bare.channel("p0").irecv(buf)
        ref = exporter.bare_send.remote(nbytes)
        pending.wait(30)
        dt = time.perf_counter() - t0
        ray.get(ref)
        return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    p, d = PrefillActor.remote(), DecodeActor.remote()
    ray.get(d.bare_connect.remote(*ray.get(p.bare_listen.remote())))
    prompt = [1 + (i * 31) % 40000 for i in range(512)]

    # Each protocol transfer is followed at once by a bare one of the same bytes, so both see the
    # same machine noise; rep 0 warms up (opens the channels).
    prefill_s, kv_s, syn_s, run_s, bare_512, bare_64 = [], [], [], [], [], []
    for rep in range(args.reps + 1):
        handle, t_prefill = ray.get(p.prefill.remote(f"r{rep}", prompt))
        t = ray.get(d.pull.remote(handle, p))
        tb = ray.get(d.bare_recv.remote(handle.nbytes, p))
        h = ray.get(p.synthetic.remote(f"s{rep}", 91 * 16))
        t64 = ray.get(d.pull.remote(h, p))
        tb64 = ray.get(d.bare_recv.remote(h.nbytes, p))
        hr = ray.get(p.synthetic.remote(f"c{rep}", 91 * 16, True))
        trun = ray.get(d.pull.remote(hr, p))
        if rep:
            run_s.append(trun)
            prefill_s.append(t_prefill)
            kv_s.append(t)
            bare_512.append(tb)
            syn_s.append(t64)
            bare_64.append(tb64)
    nbytes_512, nbytes_64 = handle.nbytes, h.nbytes
    runs = {k: sum(v) for k, v in ray.get(d.runs.remote()).items()}
    bare = {nbytes_512: statistics.median(bare_512), nbytes_64: statistics.median(bare_64)}
    deadline = time.monotonic() + 10  # the exporter frees on the ack, just after a pull returns
    while ray.get(p.free_blocks.remote()) != NUM_BLOCKS:
        assert time.monotonic() < deadline, "the prefill actor still holds blocks: a lease leaked"
        time.sleep(0.05)

    def mbps(nbytes, s):
        return nbytes / 2**20 / s

    t512, t64 = statistics.median(kv_s), statistics.median(syn_s)
    tp = statistics.median(prefill_s)
    # "paired": the median over reps of bare / protocol within the same rep (a pair runs back to back,
    # so a noisy spell on the host shifts both; the ratio of the two medians does not pair them).
    paired = lambda ours, base: statistics.median(b / o for o, b in zip(ours, base))  # noqa: E731
    rows = [("512-token prompt KV", nbytes_512, t512, bare[nbytes_512], paired(kv_s, bare_512)),
            (f"{nbytes_64 / 2**20:.1f} MiB, one run", nbytes_64, statistics.median(run_s), bare[nbytes_64],
             paired(run_s, bare_64)),
            (f"{nbytes_64 / 2**20:.1f} MiB, free-list", nbytes_64, t64, bare[nbytes_64], paired(syn_s, bare_64))]
    print(f"\nKV transfer, gloo, 2 Ray actors on one node (median of {args.reps})")
    print(f"{'payload':<22}{'MiB':>8}{'protocol ms':>13}{'MiB/s':>9}{'bare ms':>10}{'MiB/s':>9}{'vs bare':>9}{'paired':>8}")
    for name, nbytes, t, tb, pr in rows:
        print(f"{name:<22}{nbytes / 2**20:>8.1f}{t * 1e3:>13.1f}{mbps(nbytes, t):>9.0f}{tb * 1e3:>10.1f}"
              f"{mbps(nbytes, tb):>9.0f}{tb / t:>9.0%}{pr:>8.0%}")
    print(f"\n512-token prefill: {tp * 1e3:.0f} ms; its KV transfer: {t512 * 1e3:.1f} ms = {t512 / tp:.1%} of prefill")
    print(f"transfers without a copy: sender {runs['sender']}, receiver {runs['receiver']} "
          f"of {3 * (args.reps + 1)}")
    print(f"(pull all reps, ms: {[round(x * 1e3, 1) for x in kv_s]}; 64 MiB: {[round(x * 1e3, 1) for x in syn_s]})")
    ray.shutdown()


if __name__ == "__main__":
    main()
