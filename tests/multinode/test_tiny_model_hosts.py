"""A tiny random model copied to every host (as `ray up`'s file_mounts would), so each test here runs in
seconds: the HTTP door on a host of its own, streaming as the offline engine; and a burst that asks
for a second prefill worker no host has room for, until a new host joins (what an autoscaler would
add) and the next burst is shared between the two prefill hosts; last, on the same bed, a prefill worker
of TP 2 (both ranks on one prefill host) hands its KV to the TP-1 decode worker on dec1.

    driver ── bridge ──┬── head: GCS, Serve controller + proxy
                       ├── ing:  HTTP ingress replica and router (their settings place them)
                       ├── pre1: prefill worker          (pre2 joins for the scale-up; then a TP-2 one)
                       └── dec1: decode worker
"""

from __future__ import annotations

import pytest
import ray

from deployments.config import RAY_ENV_DEFAULTS, ServeConfig
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import run_offline, wait_for, wait_no_leaks
from netbed import HostSpec, deploy_http, host_of_node, pids_titled, ray_processes, start_pdserve, stream_all

pytestmark = pytest.mark.multinode

HOSTS = [HostSpec("head", 0), HostSpec("ing", 0, {"ingress": 1, "router": 1}), HostSpec("pre1", 1, {"prefill": 1}),
         HostSpec("dec1", 1, {"decode": 1})]
SETTINGS = dict(num_prefill_workers=1, prefill_max_workers=2, num_decode_workers=1, prefill_resources={"prefill": 1},
                decode_resources={"decode": 1}, router_resources={"router": 1}, ingress_resources={"ingress": 1},
                kv_cache_memory_mb=32, max_num_seqs=8, max_num_batched_tokens=32,
                # a tiny model's burst is over in a second or two: scale on the first tick that sees it
                prefill_target_queued_tokens=256, upscale_delay_s=0.0, autoscale_interval_s=0.2,
                downscale_delay_s=600.0, local_prefill_max_tokens=0, health_check_timeout_s=5.0,
                request_timeout_s=120.0)
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(make_bed, tiny_model_dir):
    local = tiny_model_dir("llama")
    bed = make_bed(HOSTS[0], HOSTS[1:], env=dict(RAY_ENV_DEFAULTS))
    model = bed.provision(local, "models/tiny-llama")  # one path, a copy on every host (and every later one)
    config = ServeConfig.from_dict({**SETTINGS, "model": model})
    router, hub = start_pdserve(config)
    return bed, router, hub, config, LLMEngine(EngineConfig(model=local, num_kv_blocks=256))


@pytest.fixture(scope="module")
def http_url(cluster):
    """The HTTP app (`build_app`): Serve's proxy on the head, the ingress replica on host `ing` by its
    setting, ingress_resources."""
    bed, _, _, config, _ = cluster
    return deploy_http(bed, config)


def test_http_chat_streams_from_another_host_as_offline(cluster, http_url):
    from openai import OpenAI

    bed, router, _, config, offline = cluster
    assert pids_titled(bed, "ing", "ray::ServeReplica:pdserve:OpenAIIngress"), ray_processes(bed, "ing")
    assert pids_titled(bed, "head", "ray::ProxyActor")
    assert pids_titled(bed, "ing", "ray::Router") and not pids_titled(bed, "head", "ray::Router")
    q = [{"role": "user", "content": "What is the capital of France?"}]
    [ref] = run_offline(offline, [offline.apply_chat_template(q)], SamplingParams(max_tokens=24, temperature=0))
    client = OpenAI(base_url=http_url, api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(model=config.served_model_name, messages=q, max_tokens=24, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    wait_no_leaks(router)


def test_status_lists_each_hosts_workers_and_the_transport_between_them(cluster, http_url, capsys):
    """`pdserve status` through the door on the head: every worker on the host its pool was pinned
    to, and the KV pair from the prefill host to the decode host with its transport and transfers
    (every prompt goes through the prefill pool here, so this request's KV crosses the veth link)."""
    import json

    import httpx

    from deployments.cli import main

    bed, _, _, config, _ = cluster
    host_by_ip = {h.ip: name for name, h in bed.hosts.items()}
    base = http_url.removesuffix("/v1")
    r = httpx.post(f"{http_url}/completions", timeout=120, json={
        "model": config.served_model_name, "prompt": "Hello there", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text

    def doc() -> dict:
        capsys.readouterr()
        assert main(["status", "--url", base, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["router"]

    got = wait_for(doc, lambda d: any(p["num_transfers"] > 0 for p in d["kv_pairs"]), timeout_s=30,
                   what="a KV pair with transfers in the router's view")
    assert {host_by_ip[w["node_ip"]] for w in got["prefill"].values()} == {"pre1"}, got["prefill"]
    assert {host_by_ip[w["node_ip"]] for w in got["decode"].values()} == {"dec1"}, got["decode"]
    pair = next(p for p in got["kv_pairs"] if p["num_transfers"] > 0)
    assert pair["transport"] == "gloo" and pair["probe_gbps"] > 0, pair
    assert main(["status", "--url", base]) == 0
    text = capsys.readouterr().out
    assert f"{pair['src']} -> {pair['dst']}" in text and "gloo" in text, text
    print(text)  # the map of a two-host run, for the record (pytest -s)


def test_the_stream_hub_lives_in_the_ingress_process(cluster, http_url):
    """No hub actor anywhere: each ingress replica holds its hub in its own process, and the workers
    on the other hosts send it tokens over the wire (the HTTP test above streamed through it)."""
    bed = cluster[0]
    where = {h: pids_titled(bed, h, "ray::StreamHub") for h in bed.hosts if h not in ("driver",)}
    assert not any(where.values()), where
    assert pids_titled(bed, "ing", "ray::ServeReplica:pdserve:OpenAIIngress")


def _burst(seed: int, n: int = 16, length: int = 300) -> list[list[int]]:
    return [[100 + (seed * 131 + i * 17 + j * 7) % 4000 for j in range(length)] for i in range(n)]


def _prefill_hosts(bed, router) -> dict[str, str]:
    stats = ray.get(router.stats.remote(), timeout=30)
    return {wid: host_of_node(bed, w["node_id"]) for wid, w in stats["prefill"].items() if w["ready"]}


def test_scale_up_waits_for_a_host_and_takes_it_when_one_joins(cluster):
    bed, router, hub, _, offline = cluster
    first = _burst(1)
    got, _ = stream_all(router, hub, first, PARAMS)
    assert got == [o.token_ids for o in run_offline(offline, first, PARAMS)]
    stats = ray.get(router.stats.remote(), timeout=30)
    ups = [d for d in stats["decisions"] if d["pool"] == "prefill" and d["action"] == "scale_up"]
    assert ups and ups[0]["to"] == 2, stats["decisions"]
    # The new worker has nowhere to run: pre1's one `prefill` is taken.
    assert stats["pools"]["prefill"]["size"] == 2 and stats["pools"]["prefill"]["ready"] == 1, stats["pools"]
    assert list(_prefill_hosts(bed, router).values()) == ["pre1"]

    bed.add_host(HostSpec("pre2", 1, {"prefill": 1}))
    hosts = wait_for(lambda: _prefill_hosts(bed, router), lambda h: sorted(h.values()) == ["pre1", "pre2"],
                     timeout_s=120, interval_s=0.5, what="the pending prefill worker ready on the new host")
    new = next(wid for wid, h in hosts.items() if h == "pre2")
    steps = _steps(router, new)
    second = _burst(2)
    got, _ = stream_all(router, hub, second, PARAMS)
    assert got == [o.token_ids for o in run_offline(offline, second, PARAMS)]
    assert _steps(router, new) > steps  # the new host prefilled part of the burst
    assert ray.get(router.stats.remote(), timeout=30)["counters"]["failed"] == 0
    wait_no_leaks(router)


def _steps(router, worker_id: str) -> int:
    return ray.get(router.check_integrity.remote(), timeout=60)[worker_id]["num_steps"]


def test_a_tp2_prefill_worker_hands_its_kv_to_a_tp1_decode_worker_on_another_host(cluster):
    """Tensor parallelism across hosts: a prefill worker of 2 ranks (both on one prefill host, its
    placement group packed there) gathers every KV head on its rank 0, which sends the blocks over the
    veth link to a TP-1 decode worker on dec1; greedy output equals the offline single engine.

    Last in this module: it shuts the module's router down and starts one of its own on the same bed
    (the bed's start is what costs), then shuts that down and checks nothing of the group is left."""
    from deployments.app import shutdown_router
    from deployments.cluster.tp_ranks import placement_group_name

    bed, _, _, config, offline = cluster
    shutdown_router(timeout_s=60)
    # 0.5 CPU a rank: both ranks fit a 1-CPU prefill host; no autoscaling (a second group has no room).
    tp_config = ServeConfig.from_dict({**SETTINGS, "model": config.engine.model, "prefill_tp": 2,
                                       "prefill_max_workers": 1, "worker_num_cpus": 0.5})
    router, hub = start_pdserve(tp_config, timeout_s=300)
    workers = ray.get(router.workers.remote(), timeout=30)
    prefill_id = next(w for w in workers if w.startswith("pdserve-prefill"))
    decode_id = next(w for w in workers if w.startswith("pdserve-decode"))
    followers = ray.get(workers[prefill_id].tp_followers.remote(), timeout=30)
    assert len(followers) == 1
    stats = ray.get(router.stats.remote(), timeout=30)
    prefill_host = host_of_node(bed, stats["prefill"][prefill_id]["node_id"])
    assert prefill_host.startswith("pre") and host_of_node(bed, stats["decode"][decode_id]["node_id"]) == "dec1"
    # Rank 1 on rank 0's host (STRICT_PACK), as a process of its own.
    assert len(pids_titled(bed, prefill_host, "ray::TPFollower")) == 1, ray_processes(bed, prefill_host)

    prompts = _burst(3, n=4, length=37)  # 10 blocks of 4 and a partial one each; chunked by 32 tokens
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got, _ = stream_all(router, hub, prompts, params)
    assert got == [o.token_ids for o in run_offline(offline, prompts, params)]
    assert ray.get(workers[decode_id].kv_stats.remote(), timeout=30)["num_received"] == len(prompts)
    pairs = wait_for(lambda: ray.get(router.stats.remote(), timeout=30)["kv_pairs"],
                     lambda ps: any(p["num_transfers"] >= len(prompts) for p in ps), timeout_s=30,
                     what="the TP pair's transfers reported")
    pair = next(p for p in pairs if p["num_transfers"] >= len(prompts))
    assert (pair["src"], pair["dst"], pair["transport"]) == (prefill_id, decode_id, "gloo"), pair
    wait_no_leaks(router)

    shutdown_router(timeout_s=60)
    wait_for(lambda: {pg["state"] for pg in ray.util.placement_group_table().values()
                      if pg.get("name") == placement_group_name(prefill_id)},
             lambda states: states <= {"REMOVED"}, timeout_s=60, what="the TP worker's placement group removed")
    wait_for(lambda: pids_titled(bed, prefill_host, "ray::TPFollower"), lambda pids: not pids, timeout_s=60,
             what=f"the follower's process on {prefill_host} ended")
