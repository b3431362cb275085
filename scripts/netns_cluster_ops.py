"""The low-level half of scripts/netns_cluster.py: commands with a timeout, finding and killing a bed's
processes, and tearing a bed down by its id alone (from any process, even after its owner died)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

BED_PREFIX = "pdsb"
SUBNET_PREFIX = "198.18"  # third octet chosen per bed; 198.18.0.0/15 is the benchmarking range
BASE_ROOT = Path(os.environ.get("PDSBED_BASE_ROOT", "/tmp"))


class BedError(RuntimeError):
    """The bed could not be brought up (the message says which step failed and where its log is)."""


def run(argv: list[str], timeout_s: float = 30.0, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kw)
    if check and res.returncode != 0:
        raise BedError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_octet() -> int:
    used = set(re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", run(["ip", "-4", "-o", "addr"]).stdout))
    free = [n for n in range(1, 250) if str(n) not in used]
    if not free:
        raise BedError(f"no free {SUBNET_PREFIX}.N.0/24 subnet left")
    return random.choice(free)


class Conn(NamedTuple):
    """One TCP connection as `ss` shows it, from the host's side."""

    local_ip: str
    local_port: int
    peer_ip: str
    peer_port: int
    pid: int | None  # the process holding it


def addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host.strip("[]").removeprefix("::ffff:"), int(port)


def ss_pid(ss_line: str) -> int | None:
    m = re.search(r"pid=(\d+)", ss_line)
    return int(m.group(1)) if m else None


def marked_pids(bed_id: str, host: str | None = None) -> list[int]:
    """Processes whose environment carries this bed's marker (and host's, if given); for the whole
    bed also those whose command line names its directory (Ray's session dir is in there)."""
    want = [f"PDSBED_ID={bed_id}".encode()] + ([f"PDSBED_HOST={host}".encode()] if host else [])
    base = str(BASE_ROOT / bed_id).encode() + b"/"
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmdline = b"" if host else (d / "cmdline").read_bytes()
        except OSError:
            continue
        if all(w in env for w in want) or (not host and base in cmdline):
            pids.append(int(d.name))
    return pids


def kill_and_wait(pids: list[int], timeout_s: float, sig: int = signal.SIGTERM, grace_s: float = 3.0) -> list[int]:
    """Send `sig`, then SIGKILL what is left after `grace_s`; returns the pids still alive after `timeout_s`."""
    def alive(p: int) -> bool:
        try:
            return Path(f"/proc/{p}/stat").read_text().split(") ", 1)[1][0] != "Z"
        except (OSError, IndexError):
            return False

    def send(targets: list[int], s: int) -> None:
        for p in targets:
            try:
                os.kill(p, s)
            except ProcessLookupError:
                pass

    deadline = time.monotonic() + timeout_s
    send(pids, sig)
    escalated = sig == signal.SIGKILL
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        if not escalated and time.monotonic() > deadline - timeout_s + grace_s:
            send(left, signal.SIGKILL)
            escalated = True
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def teardown_bed(bed_id: str, timeout_s: float = 20.0, keep_files: bool = False) -> list[int]:
    """Remove everything of bed `bed_id`, found by name (works from any process, with or without
    its state file); `keep_files`: all but its directory (the hosts' Ray logs, for a post-mortem;
    PDSBED_KEEP_FILES=1 for a NetBed). Returns the pids that survived SIGKILL (normally none)."""
    assert re.fullmatch(rf"{BED_PREFIX}[0-9a-f]{{4}}", bed_id), bed_id
    netns = _bed_netns(bed_id)
    pids = set(marked_pids(bed_id))
    for ns in netns:
        pids |= {int(p) for p in run(["ip", "netns", "pids", ns], check=False).stdout.split()}
    pids.discard(os.getpid())
    survivors = kill_and_wait(sorted(pids), timeout_s)
    # Links first: deleting a veth's root end removes both ends at once (a namespace's go asynchronously).
    for link in sorted(_bed_links(bed_id), key=lambda n: n.endswith("br")):  # the bridge last
        run(["ip", "link", "del", link], check=False)
    for ns in netns:
        run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    if keep_files:
        state = BASE_ROOT / bed_id / "bed.json"
        if state.exists():  # not a live bed any more: `list_beds` then reports it as an orphan
            state.write_text(json.dumps({**json.loads(state.read_text()), "owner_pid": None, "kept": False}))
    else:
        shutil.rmtree(BASE_ROOT / bed_id, ignore_errors=True)
    return survivors


def _bed_netns(bed_id: str) -> list[str]:
    return [line.split()[0] for line in run(["ip", "netns", "list"], check=False).stdout.splitlines()
            if line.startswith(f"{bed_id}-")]


def _bed_links(bed_id: str) -> list[str]:
    return re.findall(rf"^\d+: ({bed_id}[a-z0-9]*)[@:]", run(["ip", "-o", "link"], check=False).stdout, re.M)


def leftovers(bed_id: str) -> dict[str, list]:
    """What of bed `bed_id` still exists (namespaces, links, processes); all empty after a teardown."""
    return {"netns": _bed_netns(bed_id), "links": _bed_links(bed_id), "pids": marked_pids(bed_id)}


def list_beds() -> dict[str, dict]:
    """Beds on this machine (by their namespaces or directories): id -> state (owner pid, hosts)."""
    ids = {line.split("-")[0] for line in run(["ip", "netns", "list"], check=False).stdout.splitlines()
           if re.match(rf"{BED_PREFIX}[0-9a-f]{{4}}-", line)}
    ids |= {d.name for d in BASE_ROOT.glob(f"{BED_PREFIX}*") if re.fullmatch(rf"{BED_PREFIX}[0-9a-f]{{4}}", d.name)}
    beds = {}
    for bid in sorted(ids):
        try:
            beds[bid] = json.loads((BASE_ROOT / bid / "bed.json").read_text())
        except (OSError, ValueError):
            beds[bid] = {"id": bid}
    return beds


def teardown_orphans() -> list[str]:
    """Tear down beds whose owner process is gone (a run killed before its teardown)."""
    gone = []
    for bid, state in list_beds().items():
        pid = state.get("owner_pid")
        if not state.get("kept") and (pid is None or not Path(f"/proc/{pid}").exists()):
            teardown_bed(bid)
            gone.append(bid)
    return gone


def use_driver_env(env: dict[str, str | None]) -> dict[str, str | None]:
    """Put `env` in this process's environment (None: unset) and make Ray read it again; returns the
    values it replaced, to put back the same way after `ray.shutdown()`.

    NOTE: Ray keeps its settings, the authentication mode among them, in a per-process cache. A local
    `ray.init()` earlier in the process (any test that starts its own Ray) turns token authentication
    on in that cache for good; joining a cluster that disagrees then fails in odd places: the
    cluster's processes cannot call back into the driver, so every object and actor the driver owns
    looks dead to them (OwnerDiedError in Serve's deploy, "all references removed" for its actors)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return old
