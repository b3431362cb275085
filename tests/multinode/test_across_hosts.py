"""pdserve on five hosts (network namespaces, scripts/netns_cluster.py), the real SmolLM2 resolved and
converted by each host itself: router on the head, the HTTP ingress, the prefill pool and two decode
workers each on a host of their own. KV blocks cross the veth links; a decode host dies mid-stream
(all of its processes killed) and every stream still ends as the offline engine's; a new host joins
and takes the dead worker's place.

    driver (root ns, 0-CPU node) ── bridge ──┬── head: GCS, Serve controller + proxy, router
                                             ├── ing:  HTTP ingress replica
                                             ├── pre:  prefill worker
                                             ├── dec1 / dec2: decode workers
                                             └── dec3: joins after a decode host died
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from deployments.config import RAY_ENV_DEFAULTS, ServeConfig
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import run_offline, wait_for, wait_no_leaks
from netbed import HostSpec, deploy_http, host_of_node, pids_titled, start_pdserve, stream_all

# Five hosts with the real model: ~5 min on 2 cores. test_tiny_model_hosts keeps a cross-host stream
# (KV over the veth links) and a scale-up in the default run.
pytestmark = [pytest.mark.multinode, pytest.mark.slow]

HOSTS = [HostSpec("head", 0, {"router": 1}), HostSpec("ing", 0, {"ingress": 1}), HostSpec("pre", 1, {"prefill": 1}),
         HostSpec("dec1", 1, {"decode": 1}), HostSpec("dec2", 1, {"decode": 1})]
SETTINGS = dict(num_prefill_workers=1, num_decode_workers=2, prefill_resources={"prefill": 1},
                decode_resources={"decode": 1}, router_resources={"router": 1}, ingress_resources={"ingress": 1},
                kv_cache_memory_mb=64, max_num_seqs=8,
                # every prompt through the prefill pool: its KV crosses to a decode host
                local_prefill_max_tokens=0, health_check_timeout_s=5.0, request_timeout_s=120.0)
PROMPTS = [f"Write a short story number {i} about a {w}." for i, w in
           enumerate(["dragon", "robot", "sailor", "garden", "violin", "comet"])]
# Streams that outlast a host's death being noticed (seconds) and their move to the other host.
LONG_MAX_TOKENS = 160


@pytest.fixture(scope="module")
def cluster(make_bed):
    bed = make_bed(HOSTS[0], HOSTS[1:], env=dict(RAY_ENV_DEFAULTS))
    config = ServeConfig.from_dict(SETTINGS)
    router, hub = start_pdserve(config)  # each worker's host converts SmolLM2 itself first
    return bed, router, hub, config


@pytest.fixture(scope="module")
def offline():
    return LLMEngine(EngineConfig(model=None, num_kv_blocks=256))


def _chat_ids(engine: LLMEngine) -> list[list[int]]:
    return [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _where(bed, router) -> dict[str, list[str]]:
    stats = ray.get(router.stats.remote(), timeout=30)
    return {pool: sorted(host_of_node(bed, w["node_id"]) for w in stats[pool].values() if w["ready"])
            for pool in ("prefill", "decode")}


def test_each_role_runs_on_its_own_host(cluster):
    bed, router, _, _ = cluster
    assert _where(bed, router) == {"prefill": ["pre"], "decode": ["dec1", "dec2"]}
    assert pids_titled(bed, "head", "ray::Router")
    for host, title in (("pre", "ray::PrefillWorker"), ("dec1", "ray::DecodeWorker"), ("dec2", "ray::DecodeWorker")):
        assert pids_titled(bed, host, title), (host, title)
    # Each host converted the model into its own cache: nothing was shared but the GGUF in the venv.
    for host in ("pre", "dec1", "dec2"):
        assert list((bed.hosts[host].dir / "cache" / "gguf").iterdir()), host
    assert not (bed.hosts["ing"].dir / "cache" / "gguf").exists()


def test_kv_blocks_cross_the_veth_links(cluster, offline):
    bed, router, hub, _ = cluster
    want = [o.token_ids for o in run_offline(offline, _chat_ids(offline), _params(24))]
    workers = ray.get(router.workers.remote(), timeout=30)
    pre_sent = _kv(workers, "prefill", "bytes_sent")
    tx_before, _ = bed.link_bytes("pre")
    got, _ = stream_all(router, hub, _chat_ids(offline), _params(24))
    assert got == want
    sent = _kv(workers, "prefill", "bytes_sent") - pre_sent
    assert sent > 0 and _kv(workers, "decode", "num_received") >= len(PROMPTS)
    tx, _ = bed.link_bytes("pre")
    assert tx - tx_before >= sent  # the blocks left the prefill host over its link, nothing else can carry them
    # The gloo channels: each decode worker's connections to the prefill worker's KV ports, between
    # the two hosts' own addresses (never loopback, never another interface).
    kv_ports = _kv_listen_ports(bed)
    pre_ip = bed.hosts["pre"].ip
    for dec in ("dec1", "dec2"):
        [pid] = pids_titled(bed, dec, "ray::DecodeWorker")
        conns = [c for c in bed.tcp_peers(dec) if c.pid == pid and c.peer_port in kv_ports]
        assert conns, (dec, bed.tcp_peers(dec), kv_ports)
        assert {(c.local_ip, c.peer_ip) for c in conns} == {(bed.hosts[dec].ip, pre_ip)}, conns
    wait_no_leaks(router)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _kv(workers: dict, role: str, key: str) -> int:
    return sum(ray.get(a.kv_stats.remote(), timeout=30)[key] for wid, a in workers.items() if role in wid)


def _kv_listen_ports(bed) -> set[int]:
    """Ports the prefill worker listens on that the router does not call it on: its KV transport's
    (TCP store, gloo), not its Ray RPC port."""
    [pid] = pids_titled(bed, "pre", "ray::PrefillWorker")
    listening = bed.tcp_listening("pre", pid)
    router_calls = {c.peer_port for c in bed.tcp_peers("head") if c.peer_ip == bed.hosts["pre"].ip}
    return listening - router_calls


def test_decode_host_dies_mid_stream_streams_end_as_offline(cluster, offline):
    bed, router, hub, _ = cluster
    want = [o.token_ids for o in run_offline(offline, _chat_ids(offline), _params(LONG_MAX_TOKENS))]
    before = ray.get(router.stats.remote(), timeout=30)["counters"]
    killed: list[tuple[str, float]] = []

    async def kill_a_busy_decode_host(progress):
        deadline = time.monotonic() + 180
        while min(progress) < 5:  # every stream is decoding
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.05)
        stats = await router.stats.remote()
        victim = next(host_of_node(bed, w["node_id"]) for w in stats["decode"].values() if w["running"])
        bed.kill_host(victim)  # raylet, object store, workers: the whole node, no goodbye
        killed.append((victim, time.monotonic()))

    got, gaps = stream_all(router, hub, _chat_ids(offline), _params(LONG_MAX_TOKENS), kill_a_busy_decode_host)
    assert got == want
    after = ray.get(router.stats.remote(), timeout=30)
    assert after["counters"]["migrations"] > before["migrations"], after["counters"]
    assert after["counters"]["worker_deaths"] > before["worker_deaths"], after["counters"]
    print(f"longest stall after killing {killed[0][0]}: {max(gaps):.1f}s")
    wait_no_leaks(router)


def test_a_new_host_takes_the_dead_workers_place(cluster, offline):
    bed, router, hub, _ = cluster
    alive = sorted(h for h in ("dec1", "dec2") if bed.hosts[h].alive)
    assert len(alive) == 1, "needs the previous test's dead decode host"
    # Its replacement waits for a host with a `decode` resource: a new one joins and takes it.
    wait_for(lambda: _where(bed, router)["decode"], lambda w: w == alive, timeout_s=60, what="dead worker gone")
    bed.add_host(HostSpec("dec3", 1, {"decode": 1}))
    wait_for(lambda: _where(bed, router)["decode"], lambda w: w == sorted(alive + ["dec3"]), timeout_s=120,
             interval_s=1.0, what="a decode worker ready on the new host")
    want = [o.token_ids for o in run_offline(offline, _chat_ids(offline), _params(24))]
    got, _ = stream_all(router, hub, _chat_ids(offline), _params(24))
    assert got == want
    wait_no_leaks(router)


def test_http_chat_streams_across_hosts_as_offline(cluster, offline):
    from openai import OpenAI

    bed, router, _, config = cluster
    url = deploy_http(bed, config)  # the ingress on `ing` by its setting, ingress_resources
    assert pids_titled(bed, "ing", "ray::ServeReplica:pdserve:OpenAIIngress")
    q = PROMPTS[0]
    [ref] = run_offline(offline, [offline.apply_chat_template([{"role": "user", "content": q}])],
                        SamplingParams(max_tokens=24, temperature=0))
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(model=config.served_model_name, messages=[{"role": "user", "content": q}],
                                            max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    wait_no_leaks(router)
