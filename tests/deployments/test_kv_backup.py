"""KV backup: a prompt a decode worker computed itself is copied into a prefill worker's prefix cache,
so that the sequence, if its decode worker dies, is recomputed there from the end of its prompt.
Prefix fetch: a moved sequence resumes on another decode worker, which pulls the prompt's cached KV
from the prefill worker (without waiting for its step) and recomputes only the rest.

Real worker actors on SmolLM2, a stand-in router and stream hub. The copy must be the right KV: a
prefill of the prompt plus the tokens decoded so far (what the router sends after a death) finds the
prompt cached and samples the same next token as the undisturbed greedy run.
"""

from __future__ import annotations

import sys
import time

import pytest
import ray

from deployments.config import ServeConfig
from deployments.cluster.decode_worker import DecodeWorker
from deployments.frontend.stream_hub import StreamHub
from deployments.cluster.messages import BackupTo, FetchFrom, GenRequest
from deployments.cluster.prefill_worker import PrefillWorker
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import local_ray, run_offline, wait_for

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BS = 16


@ray.remote(num_cpus=0)
class FakeRouter:
    """Records what the workers tell the router."""

    def __init__(self):
        self.calls: dict[str, list] = {}

    def _add(self, name, *args):
        self.calls.setdefault(name, []).append(args)

    def report_decode(self, report):
        self._add("report_decode", report.finished_ids)
        self._add("report_load", report.seq, report.num_running + report.num_waiting)

    def on_prefilled(self, worker_id, request_id, handle):
        self._add("on_prefilled", request_id, handle)

    def on_finished(self, worker_id, request_id):
        self._add("on_finished", request_id)

    def on_kv_backup(self, worker_id, request_id, num_tokens, copied_tokens):
        self._add("on_kv_backup", worker_id, request_id, num_tokens, copied_tokens)

    def get(self, name):
        return self.calls.get(name, [])


class FakeHub(StreamHub):
    """Records every event the workers send it (over the wire, as they send to an ingress)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def push(self, events):
        self.events += events

    def tokens(self, request_id):
        evs = [e for e in self.events if e.request_id == request_id]
        return [t for e in sorted(evs, key=lambda e: e.offset) for t in e.token_ids], evs


def _wait(fn, timeout_s=120.0):
    return wait_for(fn, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def workers():
    with local_ray(4, namespace="pdserve-backup-test"):
        cfg = ServeConfig.from_dict(dict(num_prefill_workers=1, num_decode_workers=1, kv_cache_memory_mb=64,
                                         block_size=BS))
        router, hub = FakeRouter.remote(), FakeHub()
        prefill = PrefillWorker.options(num_cpus=1).remote("p0", cfg, router)
        decode = DecodeWorker.options(num_cpus=1).remote("d0", cfg, router)
        ray.get([prefill.info.remote(), decode.info.remote()], timeout=300)
        assert ray.get(prefill.connect_kv.remote("d0", decode), timeout=60)  # the backup channel, d0 -> p0
        yield router, hub, prefill, decode


@pytest.fixture(scope="module")
def survivor(workers):
    """A second decode worker, with nothing in its cache: where a moved sequence resumes."""
    router, _, prefill, _ = workers
    cfg = ServeConfig.from_dict(dict(num_prefill_workers=1, num_decode_workers=2, kv_cache_memory_mb=64, block_size=BS))
    d1 = DecodeWorker.options(num_cpus=1).remote("d1", cfg, router)
    ray.get(d1.info.remote(), timeout=300)
    assert ray.get(d1.connect_kv.remote("p0", prefill), timeout=60)
    return d1


def _greedy(prompt, max_tokens):
    eng = LLMEngine(EngineConfig(model=None, num_kv_blocks=64, block_size=BS))
    return run_offline(eng, [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("first_block", [0, 2])
def test_local_prefill_is_copied_to_the_prefill_cache(workers, first_block):
    router, hub, prefill, decode = workers
    prompt = [200 + (7 * i + 31 * first_block) % 20000 for i in range(5 * BS + 3)]  # 5 full blocks
    want = _greedy(prompt, 12)
    rid = f"local-{first_block}"
    if first_block:  # the prefill worker already has the prompt's first blocks (a shared prefix)
        head = f"head-{first_block}"
        ray.get(prefill.add.remote(GenRequest(head, prompt[:first_block * BS + 5], SamplingParams(max_tokens=2),
                                              "hub", hub.address, arrival_time=time.time())), timeout=30)
        handle = _wait(lambda: [c[1] for c in ray.get(router.get.remote("on_prefilled")) if c[0] == head])[0]
        assert ray.get(prefill.kv_release.remote(head, handle.epoch), timeout=30)
    req = GenRequest(rid, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), "hub", hub.address,
                     num_original_prompt_tokens=len(prompt), arrival_time=time.time())
    assert ray.get(decode.resume.remote(req, BackupTo("p0", prefill, first_block)), timeout=30).accepted
    got = _wait(lambda: [c for c in ray.get(router.get.remote("on_kv_backup")) if c[1] == rid])
    assert got == [("p0", rid, 5 * BS, (5 - first_block) * BS)]
    toks = _wait(lambda: (t := hub.tokens(rid)[0]) and len(t) == 12 and t)
    assert toks == want

    # What the router sends the prefill worker if d0 died after 6 tokens: the prompt plus those tokens.
    moved = f"moved-{first_block}"
    req2 = GenRequest(moved, prompt + want[:6], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "hub",
                      hub.address, offset=6, num_original_prompt_tokens=len(prompt), arrival_time=time.time())
    ray.get(prefill.add.remote(req2), timeout=30)
    handle = _wait(lambda: [c[1] for c in ray.get(router.get.remote("on_prefilled")) if c[0] == moved])[0]
    _, events = hub.tokens(moved)
    assert events[0].token_ids == [want[6]]  # the copied KV gives the undisturbed run's next token
    assert events[0].num_cached_tokens == 5 * BS
    assert ray.get(prefill.kv_release.remote(moved, handle.epoch), timeout=30)

    for w in (prefill, decode):  # the decode worker's pinned copy is released once the prefill worker has it
        use = _wait(lambda: (u := ray.get(w.check_integrity.remote(), timeout=30))["num_used_blocks"] == 0 and u)
        assert use["num_requests"] == 0


def test_moved_sequence_fetches_its_cached_prefix(workers, survivor):
    """The prefill worker has a prompt cached (it prefilled it); the decode worker that took it died
    after 6 tokens. The survivor pulls the cached prompt KV, recomputes only the 6 tokens, and goes
    on with the undisturbed greedy run's tokens."""
    router, hub, prefill, _ = workers
    prompt = [300 + (11 * i) % 20000 for i in range(5 * BS + 3)]
    want = _greedy(prompt, 12)
    ray.get(prefill.add.remote(GenRequest("orig", prompt, SamplingParams(max_tokens=2), "hub", hub.address,
                                          arrival_time=time.time())), timeout=30)
    handle = _wait(lambda: [c[1] for c in ray.get(router.get.remote("on_prefilled")) if c[0] == "orig"])[0]
    assert ray.get(prefill.kv_release.remote("orig", handle.epoch), timeout=30)  # now cached and free there

    moved = GenRequest("fetched", prompt + want[:6], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       "hub", hub.address, offset=6, num_original_prompt_tokens=len(prompt), arrival_time=time.time(),
                       attempt=1)
    assert ray.get(survivor.resume.remote(moved, None, FetchFrom("p0", prefill, 5 * BS)), timeout=60).accepted
    toks = _wait(lambda: (t := hub.tokens("fetched")[0]) and len(t) == 6 and t)
    assert toks == want[6:]
    _, events = hub.tokens("fetched")
    assert events[0].num_cached_tokens == 5 * BS  # the prompt came over the wire, not recomputed
    stats = ray.get(survivor.kv_stats.remote(), timeout=30)
    assert stats["prefix_fetches"] == 1 and stats["prefix_fetch_tokens"] == 5 * BS

    # Nothing cached there: the survivor computes the whole sequence itself.
    other = [900 + (13 * i) % 20000 for i in range(3 * BS + 1)]
    want2 = _greedy(other, 4)
    moved2 = GenRequest("not-cached", other, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "hub",
                        hub.address, num_original_prompt_tokens=len(other), arrival_time=time.time(), attempt=1)
    fetch = FetchFrom("p0", prefill, 3 * BS)
    assert ray.get(survivor.resume.remote(moved2, None, fetch), timeout=60).accepted
    assert _wait(lambda: (t := hub.tokens("not-cached")[0]) and len(t) == 4 and t) == want2
    assert ray.get(survivor.kv_stats.remote(), timeout=30)["prefix_fetches"] == 1

    for w in (prefill, survivor):  # the prefill worker's lease ended with the pull
        use = _wait(lambda: (u := ray.get(w.check_integrity.remote(), timeout=30))["num_used_blocks"] == 0 and u)
        assert use["num_requests"] == 0


def test_prefix_lease_does_not_wait_for_the_step_under_way(workers):
    """The prefill worker leases a cached prefix during the forward pass of a long prefill step, not
    after it: the lease is back before that prefill's first token."""
    router, hub, prefill, _ = workers
    prompt = [500 + (17 * i) % 20000 for i in range(3 * BS + 2)]
    ray.get(prefill.add.remote(GenRequest("short", prompt, SamplingParams(max_tokens=2), "hub", hub.address,
                                          arrival_time=time.time())), timeout=30)
    handle = _wait(lambda: [c[1] for c in ray.get(router.get.remote("on_prefilled")) if c[0] == "short"])[0]
    assert ray.get(prefill.kv_release.remote("short", handle.epoch), timeout=30)

    long_prompt = [700 + (19 * i) % 20000 for i in range(800)]  # one 800-token step: seconds on a CPU thread
    ray.get(prefill.add.remote(GenRequest("long", long_prompt, SamplingParams(max_tokens=2), "hub", hub.address,
                                          arrival_time=time.time())), timeout=30)
    time.sleep(0.3)  # its step is under way
    t0 = time.monotonic()
    lease = ray.get(prefill.kv_lease_prefix.remote("short", prompt, 3 * BS), timeout=30)
    took = time.monotonic() - t0
    prefilled = [c[0] for c in ray.get(router.get.remote("on_prefilled"))]
    assert lease is not None and lease.num_tokens == 3 * BS
    assert "long" not in prefilled, f"the lease waited for the step ({took:.2f}s)"
    assert ray.get(prefill.kv_release.remote(lease.request_id, lease.epoch), timeout=30)
    handle = _wait(lambda: [c[1] for c in ray.get(router.get.remote("on_prefilled")) if c[0] == "long"])[0]
    assert ray.get(prefill.kv_release.remote("long", handle.epoch), timeout=30)
    use = _wait(lambda: (u := ray.get(prefill.check_integrity.remote(), timeout=30))["num_used_blocks"] == 0 and u)
    assert use["num_requests"] == 0


def test_decode_reports_follow_changes_not_steps(workers):
    """A decode worker reports to the router when a request joins, starts or finishes, and otherwise
    at most every REPORT_EVERY_S: far fewer reports than steps, and the finish reported at once."""
    from deployments.cluster.decode_worker import REPORT_EVERY_S

    router, hub, _, decode = workers
    before = len(ray.get(router.get.remote("report_decode")))
    before_loads = len(ray.get(router.get.remote("report_load")))
    steps0 = ray.get(decode.check_integrity.remote(), timeout=30)["num_steps"]
    req = GenRequest("reports", list(range(300, 340)), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                     "hub", hub.address, num_original_prompt_tokens=40, arrival_time=time.time())
    t0 = time.monotonic()
    ans = ray.get(decode.resume.remote(req), timeout=30)
    assert ans.accepted
    _wait(lambda: (t := hub.tokens("reports")[0]) and len(t) == 60)
    elapsed = time.monotonic() - t0
    reports = _wait(lambda: [r for r in ray.get(router.get.remote("report_decode"))[before:] if "reports" in r[0]]
                    and ray.get(router.get.remote("report_decode"))[before:])
    steps = ray.get(decode.check_integrity.remote(), timeout=30)["num_steps"] - steps0
    assert steps >= 60
    # Joining, starting to decode and finishing are news; the rest is one report per interval.
    assert len(reports) <= 4 + elapsed / REPORT_EVERY_S < steps, (len(reports), steps, elapsed)
    assert [r for r in reports if "reports" in r[0]] == [(["reports"],)]
    # Numbered: the reports taken after the admission count it until the one that says it finished; the
    # ones before it (the worker idle) do not.
    loads = ray.get(router.get.remote("report_load"))[before_loads:]
    seqs = [seq for seq, _ in loads]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and min(seqs) >= 1
    finish = next(seq for (seq, _), (ids,) in zip(loads, ray.get(router.get.remote("report_decode"))[before:])
                  if "reports" in ids)
    assert [n for seq, n in loads if seq <= ans.report_seq] == [0] * sum(seq <= ans.report_seq for seq in seqs)
    during = [n for seq, n in loads if ans.report_seq < seq < finish]
    assert during and all(n == 1 for n in during)


def test_an_abort_that_overtakes_its_add_drops_that_attempt(workers):
    """The worker runs its calls on a thread pool, so the router's abort, sent right after the `add`,
    may run first: the `add` of that attempt then never starts (a later attempt does)."""
    router, hub, prefill, _ = workers

    def req(rid, attempt=0):
        r = GenRequest(rid, [300 + i for i in range(BS + 2)], SamplingParams(max_tokens=2), "hub", hub.address,
                       arrival_time=time.time())
        r.attempt = attempt
        return r

    def prefilled(rid):
        return [c[1] for c in ray.get(router.get.remote("on_prefilled"), timeout=30) if c[0] == rid]

    assert ray.get(prefill.abort.remote("overtaken", 0, True), timeout=30) is False  # not here yet
    assert ray.get(prefill.abort.remote("retried", 0, True), timeout=30) is False
    assert ray.get(prefill.num_abort_marks.remote(), timeout=30) == 2
    ray.get([prefill.add.remote(req("overtaken")), prefill.add.remote(req("retried", attempt=1))], timeout=30)
    assert ray.get(prefill.num_abort_marks.remote(), timeout=30) == 1  # attempt 1 was not the one aborted
    handle = _wait(lambda: prefilled("retried"))[0]
    assert ray.get(prefill.kv_release.remote("retried", handle.epoch), timeout=30)
    ray.get(prefill.add.remote(req("after")), timeout=30)  # queued behind anything "overtaken" would be
    handle = _wait(lambda: prefilled("after"))[0]
    assert ray.get(prefill.kv_release.remote("after", handle.epoch), timeout=30)
    assert prefilled("overtaken") == []
    use = _wait(lambda: (u := ray.get(prefill.check_integrity.remote(), timeout=30))["num_used_blocks"] == 0 and u)
    assert use["num_requests"] == 0
