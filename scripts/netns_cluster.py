#!/usr/bin/env python3
"""A multi-node Ray cluster on one machine, for tests: every host is a Linux network namespace.

    root namespace: the driver (pytest) and a 0-CPU Ray node of its own, on the bridge's address
        198.18.N.254  bridge <id>br
          ├── veth ── netns <id>-head   198.18.N.1   ray start --head (GCS)
          ├── veth ── netns <id>-pre    198.18.N.2   ray start --address 198.18.N.1:6379
          └── veth ── netns <id>-dec1   198.18.N.3   ...   (hosts may join later: add_host)

Each host also has its own hostname (UTS namespace), its own monotonic clock (a time namespace,
offset by weeks per host: nothing may compare monotonic times across hosts) and its own files: a
directory private to the host is mounted at the same path (`node_dir`) on every host, and its HOME,
TMPDIR, PDSERVE_CACHE_DIR and Ray's temp dir live there. A path one host writes does not exist on
another, as on separate machines. Files every host needs are copied to each (`provision`), as
`ray up`'s file_mounts would. Only the code and the venv come from the shared disk (a real cluster
installs them on every node in its setup commands).

Traffic stays inside the bed: the namespaces have no route but their veth to the bridge, and
addresses come from 198.18.0.0/15 (the benchmarking range) only.

The driver cannot join without a raylet on its own node (Ray's drivers attach to a local raylet), so
it gets a node of its own in the root namespace, with no CPUs: `ray.init(**bed.ray_init_kwargs())`.

Never `ray stop` here: it kills every Ray process of the machine (it matches process names), other
users' included. The bed kills its own processes: those in its namespaces and those carrying its
marker in their environment (PDSBED_ID), and nothing else.

CLI: `netns_cluster.py up --host head:cpus=0:router=1 --host dec1:cpus=1:decode=1` (leaves it running,
prints its id and addresses), `netns_cluster.py down <id>` or `down --all`, `netns_cluster.py list`.
Needs root (ip netns, mount, unshare).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from netns_cluster_ops import (BASE_ROOT, BED_PREFIX, SUBNET_PREFIX, BedError, Conn, addr, free_octet, free_port,
                               kill_and_wait, leftovers, list_beds, marked_pids, run, ss_pid, teardown_bed,
                               teardown_orphans, use_driver_env)  # noqa: F401 - use_driver_env: for drivers

__all__ = ["BedError", "Conn", "Host", "HostSpec", "NetBed", "leftovers", "list_beds", "teardown_bed",
           "teardown_orphans"]

GCS_PORT = 6379
DRIVER_OCTET = 254
CLOCK_OFFSET_S = 14 * 86400  # per host index: monotonic clocks weeks apart
REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON_BIN = Path(sys.executable).parent  # the venv running this: its `ray`, its python


_SKEW_HOOK = """# netns_cluster: this host's wall clock runs PDSBED_WALL_CLOCK_SKEW_S ahead (Python processes only).
import os
import time

_skew = float(os.environ.get("PDSBED_WALL_CLOCK_SKEW_S") or 0)
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
"""


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One host to start: its name (a few letters: it names the namespace), its CPUs and custom resources."""

    name: str
    num_cpus: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    # The host's Python processes see a wall clock (time.time) this far ahead (a sitecustomize
    # hook: a kernel has one realtime clock, which namespaces cannot offset).
    wall_clock_skew_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> HostSpec:
        """`name[:cpus=N][:resource=amount...]`, as the CLI takes it."""
        name, *items = text.split(":")
        kv = dict(item.split("=", 1) for item in items)
        cpus = int(kv.pop("cpus", 1))
        skew = float(kv.pop("skew", 0))
        return cls(name, cpus, {k: float(v) for k, v in kv.items()}, skew)


@dataclass(slots=True)
class Host:
    name: str
    index: int
    ip: str
    netns: str | None  # None: the driver's node in the root namespace
    veth: str | None  # the root-side end of its link
    dir: Path  # its private directory, as the root namespace sees it
    wall_clock_skew_s: float = 0.0
    alive: bool = True


class NetBed:
    """A bed of hosts; `start` brings it up, `teardown` (idempotent, also at exit) removes all of it."""

    def __init__(self, env: dict[str, str] | None = None, python_bin: Path = DEFAULT_PYTHON_BIN,
                 object_store_mb: int = 100, keep: bool = False):
        """`env`: extra environment for every host's Ray processes (the GCS's health-check settings,
        Serve's). `keep`: leave the bed up at interpreter exit (the CLI's `up`)."""
        self.id = f"{BED_PREFIX}{os.urandom(2).hex()}"
        self.base = BASE_ROOT / self.id
        self.node_dir = self.base / "node"  # every host's private dir is mounted here, in its own view
        self.octet = free_octet()
        self.bridge = f"{self.id}br"
        self.env = dict(env or {})
        # Ray's token authentication, on as on a default Ray cluster: every host and the driver use it.
        self.auth_token = secrets.token_hex(32)
        self.python_bin = python_bin
        self.object_store_mb = object_store_mb
        self.hosts: dict[str, Host] = {}
        self.provisions: list[tuple[Path, str]] = []
        self._next_index = 1
        self._torn_down = False
        self.keep = keep
        if not keep:
            atexit.register(self.teardown)

    # ------------------------------------------------------------------ addresses
    @property
    def gcs_address(self) -> str:
        return f"{self.ip(1)}:{GCS_PORT}"

    @property
    def driver_ip(self) -> str:
        return self.ip(DRIVER_OCTET)

    def ip(self, host_octet: int) -> str:
        return f"{SUBNET_PREFIX}.{self.octet}.{host_octet}"

    def ray_init_kwargs(self) -> dict:
        """What `ray.init` needs to join from this process, through the driver's node (with
        `driver_env()` in force: `use_driver_env`)."""
        return {"address": self.gcs_address, "_node_ip_address": self.driver_ip}

    def driver_env(self) -> dict[str, str]:
        """The environment a driver that joins this bed needs: the bed's Ray token authentication."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.auth_token}

    def node_path(self, rel: str) -> str:
        """The path of `rel` inside a host's private dir: the same string on every host."""
        return str(self.node_dir / rel)

    # ------------------------------------------------------------------ bring-up
    def start(self, head: HostSpec, others: list[HostSpec] = (), timeout_s: float = 180.0) -> NetBed:
        """Bridge, head, the other hosts, then the driver's node; raises BedError (after tearing
        down what was started) if any step fails or the whole takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        try:
            self.base.mkdir(parents=True)
            self.node_dir.mkdir()
            self._write_state()
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "addr", "add", f"{self.driver_ip}/24", "dev", self.bridge])
            run(["ip", "link", "set", self.bridge, "up"])
            self._start_host(head, head=True, deadline=deadline)
            for spec in others:
                self._start_host(spec, head=False, deadline=deadline)
            self._start_driver_node(deadline)
        except BaseException:
            self.teardown()
            raise
        return self

    def add_host(self, spec: HostSpec, timeout_s: float = 120.0) -> Host:
        """A new host joins the running cluster (a node an autoscaler would add)."""
        return self._start_host(spec, head=False, deadline=time.monotonic() + timeout_s)

    def provision(self, src: str | Path, rel: str) -> str:
        """Copy file or directory `src` into every host's private dir (and every later host's) at
        `rel`; returns the path it has on every host (`node_path(rel)`)."""
        src = Path(src)
        self.provisions.append((src, rel))
        for host in self.hosts.values():
            self._copy_into(host, src, rel)
        return self.node_path(rel)

    def _copy_into(self, host: Host, src: Path, rel: str) -> None:
        dst = host.dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)

    def _new_host(self, name: str, netns: bool, octet: int | None = None, skew_s: float = 0.0) -> Host:
        assert re.fullmatch(r"[a-z][a-z0-9]{0,9}", name) and name not in self.hosts, f"bad or taken host name {name!r}"
        index = self._next_index
        self._next_index += 1
        # The driver's node sees the root's view of node_dir; the others mount their own over it.
        hdir = self.node_dir if not netns else self.base / "hosts" / name
        host = Host(name, index, self.ip(octet or index), f"{self.id}-{name}" if netns else None,
                    f"{self.id}v{index}" if netns else None, hdir, skew_s)
        for sub in ("home", "tmp", "cache"):
            (hdir / sub).mkdir(parents=True, exist_ok=True)
        if skew_s:
            (hdir / "pyskew").mkdir(exist_ok=True)
            (hdir / "pyskew" / "sitecustomize.py").write_text(_SKEW_HOOK)
        for src, rel in self.provisions:
            self._copy_into(host, src, rel)
        self.hosts[name] = host
        self._write_state()
        return host

    def _start_host(self, spec: HostSpec, head: bool, deadline: float) -> Host:
        host = self._new_host(spec.name, netns=True, skew_s=spec.wall_clock_skew_s)
        ns, veth = host.netns, host.veth
        run(["ip", "netns", "add", ns])
        self._write_etc_hosts()
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        run(["ip", "link", "set", veth, "master", self.bridge, "up"])
        for argv in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{host.ip}/24", "dev", "eth0"],
                     ["ip", "link", "set", "eth0", "up"]):
            run(["ip", "netns", "exec", ns, *argv])
        args = ["--head", "--port", str(GCS_PORT), "--include-dashboard=false"] if head else ["--address", self.gcs_address]
        args += ["--num-cpus", str(int(spec.num_cpus)), "--resources", json.dumps(spec.resources)]
        offset = str(CLOCK_OFFSET_S * host.index)
        # NOTE: `ip netns exec` gives each call a mount namespace of its own, so this bind mount (and
        # the host's hostname, and its clock offset) hold for the Ray processes started here alone.
        wrapper = ["ip", "netns", "exec", ns, "unshare", "--uts", "--time", "--monotonic", offset, "--boottime", offset,
                   "--", "sh", "-c", 'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"',
                   "sh", host.name, str(host.dir), str(self.node_dir)]
        self._ray_start(host, wrapper, args, deadline)
        return host

    def _start_driver_node(self, deadline: float) -> None:
        host = self._new_host("driver", netns=False, octet=DRIVER_OCTET)
        # The root namespace is shared with other Ray instances: no fixed port may be assumed free.
        ports = {flag: str(free_port()) for flag in ("--node-manager-port", "--object-manager-port",
                                                     "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                                     "--runtime-env-agent-port", "--metrics-export-port")}
        args = ["--address", self.gcs_address, "--num-cpus", "0", *[x for kv in ports.items() for x in kv]]
        self._ray_start(host, [], args, deadline)

    def _host_env(self, host: Host) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST_"))}
        env.update(self.env)
        nd = self.node_dir
        env.update(PDSBED_ID=self.id, PDSBED_HOST=host.name, HOME=str(nd / "home"), TMPDIR=str(nd / "tmp"),
                   PDSERVE_CACHE_DIR=str(nd / "cache"), RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", **self.driver_env())
        if host.wall_clock_skew_s:
            env["PDSBED_WALL_CLOCK_SKEW_S"] = str(host.wall_clock_skew_s)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(nd / "pyskew"), env.get("PYTHONPATH")]))
        return env

    def _ray_start(self, host: Host, wrapper: list[str], args: list[str], deadline: float) -> None:
        argv = [*wrapper, str(self.python_bin / "ray"), "start", "--node-ip-address", host.ip,
                "--temp-dir", str(self.node_dir / "ray"), "--disable-usage-stats", "--include-log-monitor=false",
                "--object-store-memory", str(self.object_store_mb * 2**20), *args]
        log = self.base / f"ray-start-{host.name}.log"
        left = deadline - time.monotonic()
        if left <= 0:
            raise BedError(f"no time left to start host {host.name}")
        with open(log, "w") as out:
            try:
                res = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=self._host_env(host),
                                     timeout=left, cwd=str(REPO))
            except subprocess.TimeoutExpired:
                raise BedError(f"ray start on {host.name} took over {left:.0f}s; see {log}") from None
        if res.returncode != 0:
            raise BedError(f"ray start on {host.name} failed ({res.returncode}); see {log}:\n{log.read_text()[-2000:]}")

    def _write_etc_hosts(self) -> None:
        # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: every host resolves every name.
        lines = ["127.0.0.1 localhost"] + [f"{h.ip} {h.name}" for h in self.hosts.values()]
        for h in self.hosts.values():
            if h.netns:
                d = Path("/etc/netns") / h.netns
                d.mkdir(parents=True, exist_ok=True)
                with open(d / "hosts", "w") as f:  # rewritten in place: a running host's bind mount sees it
                    f.write("\n".join(lines) + "\n")

    def _write_state(self) -> None:
        # owner_pid: a bed whose owner died before its teardown is an orphan (`teardown_orphans`).
        state = {"id": self.id, "owner_pid": None if self.keep else os.getpid(), "kept": self.keep,
                 "gcs_address": self.gcs_address, "driver_ip": self.driver_ip, "node_dir": str(self.node_dir),
                 "driver_env": self.driver_env(),
                 "hosts": {h.name: {"ip": h.ip, "netns": h.netns, "alive": h.alive} for h in self.hosts.values()}}
        (self.base / "bed.json").write_text(json.dumps(state, indent=1))

    # ------------------------------------------------------------------ looking in, breaking things
    def pids(self, name: str) -> list[int]:
        """Every process of host `name` (for a namespaced host: everything in its namespace)."""
        host = self.hosts[name]
        found = set(marked_pids(self.id, host.name))
        if host.netns:
            res = run(["ip", "netns", "pids", host.netns], check=False)
            found |= {int(p) for p in res.stdout.split()}
        return sorted(found)

    def kill_host(self, name: str, timeout_s: float = 15.0) -> int:
        """The host dies: SIGKILL to all of its processes (raylet, object store, workers), no
        goodbye to the GCS. Returns how many processes were killed."""
        host = self.hosts[name]
        assert host.netns, "the driver's node cannot be killed under a connected driver"
        pids = self.pids(name)
        kill_and_wait(pids, timeout_s, sig=signal.SIGKILL)
        host.alive = False
        self._write_state()
        return len(pids)

    def exec(self, name: str, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run a command in host `name`'s network namespace."""
        host = self.hosts[name]
        return run(["ip", "netns", "exec", host.netns, *argv] if host.netns else argv, timeout_s, check=False)

    def tcp_peers(self, name: str) -> list[Conn]:
        """Established TCP connections in host `name` (IPv4-mapped IPv6 addresses as plain IPv4)."""
        return [Conn(*addr(p[2]), *addr(p[3]), ss_pid(line)) for line in
                self.exec(name, ["ss", "-Htnp", "state", "established"]).stdout.splitlines()
                if len(p := line.split()) >= 4]

    def tcp_listening(self, name: str, pid: int) -> set[int]:
        """TCP ports process `pid` of host `name` listens on."""
        return {addr(p[3])[1] for line in self.exec(name, ["ss", "-Htlnp"]).stdout.splitlines()
                if len(p := line.split()) >= 4 and ss_pid(line) == pid}

    def link_bytes(self, name: str) -> tuple[int, int]:
        """(sent, received): bytes host `name` put on and took off its veth link so far."""
        # Counted at the root-side end: what it receives, the host sent.
        stats = Path("/sys/class/net") / self.hosts[name].veth / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Kill every process of the bed, delete its namespaces, links and directories. Idempotent;
        safe after a failed bring-up."""
        if self._torn_down:
            return
        self._torn_down = True
        teardown_bed(self.id, keep_files=os.environ.get("PDSBED_KEEP_FILES") == "1")

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring a bed up and leave it running")
    up.add_argument("--host", action="append", required=True,
                    help="name[:cpus=N][:resource=amount...]; the first is the head")
    down = sub.add_parser("down", help="tear beds down")
    down.add_argument("bed_id", nargs="*")
    down.add_argument("--all", action="store_true", help="every bed on this machine")
    sub.add_parser("list", help="beds on this machine")
    args = p.parse_args(argv)
    if args.cmd == "up":
        specs = [HostSpec.parse(h) for h in args.host]
        bed = NetBed(keep=True).start(specs[0], specs[1:])
        state = json.loads((bed.base / "bed.json").read_text())
        print(json.dumps(state, indent=1))
        print(f"join: with the driver_env above, ray.init(address={bed.gcs_address!r}, "
              f"_node_ip_address={bed.driver_ip!r}); "
              f"down: {sys.argv[0]} down {bed.id}", file=sys.stderr)
    elif args.cmd == "down":
        for bid in (list(list_beds()) if args.all else args.bed_id):
            left = teardown_bed(bid)
            print(f"{bid}: down" + (f" (pids still alive: {left})" if left else ""))
    else:
        print(json.dumps(list_beds(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
