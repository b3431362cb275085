"""CPU workers of one node share its cores by how many have work (deployments/cluster/core_share.py):
a busy worker alone takes every core, busy workers split them, never below their own thread count,
and a worker that died holding its lock does not count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deployments.cluster import core_share
from deployments.cluster.core_share import CoreShare, node_cores

ROOT = Path(__file__).resolve().parents[2]


def test_busy_workers_split_the_cores_and_an_idle_one_gives_its_share(tmp_path, monkeypatch):
    monkeypatch.setattr(core_share, "RELIST_S", 0.0)
    prefill, decode = CoreShare(tmp_path, "prefill", cores=4, floor=1), CoreShare(tmp_path, "decode", 4, 1)
    third = CoreShare(tmp_path, "third", cores=4, floor=3)
    try:
        decode.set_busy(True)
        assert decode.threads() == 4  # alone with work: every core
        prefill.set_busy(True)
        assert decode.threads() == 2 and prefill.threads() == 2
        third.set_busy(True)
        assert decode.threads() == 1 and third.threads() == 3  # never below its own thread count
        prefill.set_busy(False)
        third.set_busy(False)
        assert decode.threads() == 4
        prefill.set_busy(True)
        prefill.close()  # gone: its file and its count with it
        assert decode.threads() == 4 and not (tmp_path / "prefill").exists()
    finally:
        decode.close()
        third.close()


def test_a_newly_busy_worker_waits_for_room_not_longer_than_its_bound(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(core_share, "RELIST_S", 0.0)
    monkeypatch.setattr(core_share, "ROOM_WAIT_S", 0.3)
    decode, prefill = CoreShare(tmp_path, "decode", cores=2, floor=1), CoreShare(tmp_path, "prefill", 2, 1)
    try:
        decode.set_busy(True)
        decode.claim(decode.threads(), newly_busy=True)  # alone: both cores, no wait
        prefill.set_busy(True)
        t0 = time.monotonic()
        prefill.claim(prefill.threads(), newly_busy=True)  # decode's step still holds both cores
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 2.0
        decode.claim(decode.threads(), newly_busy=False)  # decode's next step: its share, one core
        # NOTE: no fixed bound: with a 60 s room wait, a claim that waited at all takes 60 s; one that
        # found room returns at once (far under half of it however busy the host).
        monkeypatch.setattr(core_share, "ROOM_WAIT_S", 60.0)
        t0 = time.monotonic()
        prefill.claim(1, newly_busy=True)
        assert time.monotonic() - t0 < 30.0  # room now
    finally:
        decode.close()
        prefill.close()


def test_a_worker_that_died_busy_does_not_count(tmp_path, monkeypatch):
    monkeypatch.setattr(core_share, "RELIST_S", 0.0)
    code = ("import os, sys; from pathlib import Path; from deployments.cluster.core_share import CoreShare; "
            "s = CoreShare(Path(sys.argv[1]), 'dead', 2, 1); s.set_busy(True); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, check=True, timeout=60)
    assert (tmp_path / "dead").exists()
    me = CoreShare(tmp_path, "me", cores=2, floor=1)
    try:
        me.set_busy(True)
        assert me.busy_peers() == 0 and me.threads() == 2
    finally:
        me.close()


def test_node_cores_is_bounded_by_the_nodes_ray_cpus():
    assert node_cores(None) >= 1
    assert node_cores(1.0) == 1
    assert node_cores(10_000.0) == node_cores(None)
