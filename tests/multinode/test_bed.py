"""The bed itself (scripts/netns_cluster.py): hosts are apart (network, files, names, clocks), nothing
leaves the bed's links, a host dies whole, and teardown removes everything, after a failed bring-up too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from netbed import HostSpec, NetBed, bed_unavailable, netns_cluster

pytestmark = pytest.mark.multinode

PROBE = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print('ok')\n"
         "except OSError as e:\n"
         "    print(type(e).__name__, e.errno)\n")


@pytest.fixture(autouse=True)
def _needs_a_bed():
    why = bed_unavailable()
    if why:
        pytest.skip(why)


def _connect(bed: NetBed, host: str, ip: str, port: int) -> str:
    import sys

    return bed.exec(host, [sys.executable, "-c", PROBE, ip, str(port)]).stdout.strip()


def _gone(bed: NetBed) -> bool:
    return not any(netns_cluster.leftovers(bed.id).values()) and not bed.base.exists()


def test_hosts_are_apart_and_teardown_removes_everything():
    with NetBed() as bed:
        bed.start(HostSpec("head", 0), [HostSpec("a", 1, {"a": 1})])
        head, a = bed.hosts["head"], bed.hosts["a"]
        assert _connect(bed, "a", head.ip, 6379) == "ok"  # the GCS, over the link
        assert _connect(bed, "a", "192.0.2.1", 80).startswith("OSError 101")  # no route out of the bed
        # Each host sees its own private dir at the same path; the root sees the driver node's.
        [raylet] = [p for p in bed.pids("a") if Path(f"/proc/{p}/comm").read_text().strip() == "raylet"]
        view = Path(f"/proc/{raylet}/root") / str(bed.node_dir).lstrip("/")
        (a.dir / "home" / "only-on-a").write_text("a")
        assert (view / "home" / "only-on-a").exists() and not (bed.node_dir / "home" / "only-on-a").exists()
        assert os.readlink(f"/proc/{raylet}/ns/uts") != os.readlink("/proc/self/ns/uts")
        assert os.readlink(f"/proc/{raylet}/ns/time") != os.readlink("/proc/self/ns/time")
        assert bed.kill_host("a") > 0 and bed.pids("a") == []
    assert _gone(bed)
    bed.teardown()  # idempotent


def test_a_failed_bring_up_leaves_nothing():
    bed = NetBed()
    with pytest.raises(netns_cluster.BedError, match="ray start on bad failed"):
        bed.start(HostSpec("head", 0), [HostSpec("bad", 1, {"CPU": 2})])  # Ray refuses CPU as a custom resource
    assert _gone(bed)
