"""The router's plain parts (placement, pools, recovery) on worker views, without Ray: `Parts` builds
a `RouterState` with ready workers; the tests drive the parts and check the state and the actions
(the Ray calls the router actor would make) exactly."""

from __future__ import annotations

import time

import pytest

from deployments.cluster.messages import DecodeReport, GenRequest, ModelInfo, Role, WorkerInfo
from deployments.cluster.placement import Placement
from deployments.cluster.pools import Pools
from deployments.cluster.prefix_index import PrefixIndex
from deployments.cluster.recovery import Recovery
from deployments.cluster.state import RouterState, Stage, Tracked, WorkerView
from deployments.config import ServeConfig
from engine import SamplingParams
from kv_transfer import KVHandle
from kv_transfer.handle import KVLayout

BS = 16  # the default block size
NUM_BLOCKS = 100


class Parts:
    """A router's state and its three plain parts, wired as the router actor wires them."""

    def __init__(self, workers: tuple[str, ...] = ("p0", "d0"), **settings):
        if workers:  # else the pools' sizes are the settings' (`start_pools`)
            settings.setdefault("num_prefill_workers", sum(w.startswith("p") for w in workers))
            settings.setdefault("num_decode_workers", sum(w.startswith("d") for w in workers))
        self.config = ServeConfig.from_dict(settings)
        self.state = RouterState(PrefixIndex(self.config.engine.block_size))
        self.placement = Placement(self.config, self.state)
        self.pools = Pools(self.config, self.state, self.placement)
        self.recovery = Recovery(self.config, self.state, self.placement)
        for wid in workers:
            self.add_worker(wid)

    def start_pools(self) -> list[WorkerView]:
        """The pools' start sizes as the router starts them (`Pools.fill`), every worker ready."""
        views = self.pools.fill()
        for w in views:
            w.info = WorkerInfo(w.worker_id, w.role, ModelInfo("model", 1024, 1000), NUM_BLOCKS, BS, "127.0.0.1",
                                "node")
            w.ready = True
        return views

    def add_worker(self, worker_id: str, ready: bool = True, num_blocks: int = NUM_BLOCKS) -> WorkerView:
        """`p*` a prefill worker, `d*` a decode worker."""
        role = Role.PREFILL if worker_id.startswith("p") else Role.DECODE
        info = WorkerInfo(worker_id, role, ModelInfo("model", 1024, 1000), num_blocks, BS, "127.0.0.1", "node")
        w = self.state.pools[role][worker_id] = WorkerView(worker_id, role, info=info, ready=ready)
        if self.config.routes_by_prefix:
            self.state.prefix_index.add_worker(worker_id, num_blocks)
        return w

    def w(self, worker_id: str) -> WorkerView:
        return self.state.prefill.get(worker_id) or self.state.decode[worker_id]

    def submit(self, rid: str, num_tokens: int, priority: int = 0, arrival: float = 0.0, first: int = 1) -> Tracked:
        """Track a new request of `num_tokens` prompt tokens `first`, `first` + 1, ... (not placed yet)."""
        req = request(rid, num_tokens, priority, arrival, first)
        t = self.state.tracked[rid] = Tracked(req, req.params, Stage.UNPLACED)
        return t

    def report(self, worker_id: str, free: int, running: int = 0, waiting: int = 0, backlog: int = 0,
               finished: tuple[str, ...] = ()) -> DecodeReport:
        return DecodeReport(worker_id, free, NUM_BLOCKS, running, waiting, list(finished), prefill_backlog=backlog)


def request(rid: str, num_tokens: int, priority: int = 0, arrival: float = 0.0, first: int = 1,
            max_tokens: int = 20) -> GenRequest:
    return GenRequest(rid, list(range(first, first + num_tokens)), SamplingParams(max_tokens=max_tokens), "hub", None,
                      priority=priority, num_original_prompt_tokens=num_tokens, arrival_time=arrival)


def kv_handle(worker_id: str, rid: str, num_tokens: int, epoch: int = 1) -> KVHandle:
    """The lease a prefill worker hands out on `rid`'s prompt KV."""
    blocks = tuple(range(-(-num_tokens // BS)))
    return KVHandle(worker_id, rid, blocks, num_tokens, KVLayout(2, 2, 8, "float32", BS), 42, epoch,
                    time.time() + 60)


@pytest.fixture
def parts() -> Parts:
    """One prefill and one decode worker, no prefix-aware routing (placement by load alone)."""
    return Parts(prefix_aware_routing=False)
