"""The follower ranks of a tensor-parallel engine, and a launcher for them on this host (no Ray).

A follower (`run_follower`, a plain function: a process here, a Ray actor later) joins the group,
loads the model, keeps its shard and a KV pool of its KV heads, then runs each step rank 0 hands it
until rank 0 says stop or goes away. It owns no scheduler, block manager or sampler: the step message
carries the block tables and slots rank 0's block manager chose.

    launch_local(config)                       follower r (spawned process)
      leader_store() -> init_method  ───────▶  run_follower(config, r, W, init_method)
      TPGroup.connect(0, ...)   ◀── group ──▶    TPGroup.connect(r, ...)
      LLMEngine(config, tp_group)                build_runner(...)   (same pool size: min over ranks)
      engine.step(): runner.run ── Step ────▶    runner.run_eager(host inputs)
      engine.close()            ── Shutdown ─▶   return
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.errors import EngineConfigError
from engine.parallel.group import DEFAULT_TIMEOUT_S, LeaderGone, TPGroup, leader_store
from engine.parallel.messages import KVGatherMessage, KVScatterMessage, ShutdownMessage, StepMessage

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # how long close() waits for a follower process to end before killing it


def rank_device(device: str, rank: int) -> str:
    """The device of `rank` on one host: CUDA ranks take GPU `rank` unless the device names an index
    (a Ray actor sees its one GPU as cuda:0 and passes that)."""
    return f"cuda:{rank}" if device == "cuda" else device


def run_follower(config: EngineConfig, rank: int, world: int, init_method: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S, idle_timeout_s: float | None = None,
                 poll_s: float = 30.0) -> str:
    """Rank `rank` (> 0) of `world`: join the group at `init_method`, build this rank's runner, run
    steps until rank 0 sends Shutdown or goes away. Returns why it stopped ("shutdown", "leader gone").

    Every wait is bounded: the group's rendezvous and each collective by `timeout_s` (a rank that
    died fails the step), the wait for the next message by rank 0's store staying reachable (its
    connection closing ends the wait; a wait lasts `poll_s` at most before it is renewed) and, when
    given, `idle_timeout_s` without any message."""
    from engine.host_memory import keep_freed_memory
    from engine.model_setup import build_runner, load_model

    if not 0 < rank < world:
        raise EngineConfigError(f"a follower's rank must be in [1, {world}), got {rank}")
    config = replace(config, device=rank_device(config.device, rank))
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if torch.device(config.device).type == "cpu":
        keep_freed_memory()
    tp = TPGroup.connect(rank, world, init_method, config.device, timeout_s)
    try:
        hf_model, _, _, matmul_dtype, weights = load_model(config, tp=tp)
        runner = build_runner(config, hf_model, matmul_dtype, tp, weights)
        from engine.attention import attention_backends

        while True:
            try:
                msg = tp.recv(poll_s, idle_timeout_s)
            except LeaderGone as e:
                logger.warning("TP rank %d: %s; stopping", rank, e)
                return "leader gone"
            if isinstance(msg, ShutdownMessage):
                return "shutdown"
            if isinstance(msg, (KVGatherMessage, KVScatterMessage)):
                from engine.parallel.kv_shards import follow_kv
                follow_kv(runner, msg)
                continue
            if not isinstance(msg, StepMessage):
                raise TypeError(f"TP rank {rank}: unknown message {type(msg).__name__}")
            with torch.inference_mode(), attention_backends(runner.device):
                runner.run_eager(msg.host_step)
    finally:
        tp.close()


def _follower_main(config, rank, world, init_method, timeout_s, idle_timeout_s) -> None:
    """A spawned follower process's entry (logging set up, a clean exit code)."""
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"))
    run_follower(config, rank, world, init_method, timeout_s, idle_timeout_s)


def launch_local(config: EngineConfig, world: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 idle_timeout_s: float | None = None, host: str = "127.0.0.1"):
    """Rank 0's `LLMEngine` of a `world`-rank group (default `config.tensor_parallel_size`) whose
    followers are processes spawned here (torch.multiprocessing, rendezvous over localhost TCP).
    `engine.close()` stops them; so does this process ending. On a CPU, `num_threads` unset gives
    each rank an equal share of the host's cores."""
    import torch.multiprocessing as mp

    from engine.llm_engine import LLMEngine

    world = config.tensor_parallel_size if world is None else world
    config = replace(config, tensor_parallel_size=world)  # validated here
    if config.num_threads is None and torch.device(config.device).type == "cpu":
        # N processes with torch's default (every core each) would oversubscribe the host's cores.
        config = replace(config, num_threads=max(1, (os.cpu_count() or 1) // world))
    check_tp_model(config)
    if world == 1:
        return LLMEngine(config)
    store, init_method = leader_store(world, host, timeout_s)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower_main, args=(config, r, world, init_method, timeout_s, idle_timeout_s),
                         name=f"pdserve-tp-rank{r}", daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        tp = join_watching(lambda: TPGroup.connect(0, world, init_method, rank_device(config.device, 0), timeout_s,
                                                   store=store), lambda: _exited(procs))
        engine = LLMEngine(config, tp_group=tp)
    except BaseException:
        _stop(procs, 0.0)
        raise
    engine._on_close.append(lambda: _stop(procs, JOIN_TIMEOUT_S))
    engine.follower_pids = [p.pid for p in procs]
    return engine


def check_tp_model(config: EngineConfig) -> None:
    """`EngineConfigError` naming the field if the model cannot be split over
    `config.tensor_parallel_size` ranks: checked before any rank starts (a GGUF model is converted
    once here, and the followers find it converted)."""
    from transformers import AutoConfig

    from engine.model_loader import resolve_model_dir
    from engine.models.sharding import check_tp_shapes

    load_dtype = "float32" if config.dtype == "bfloat16" and config.device == "cpu" else config.dtype
    model_dir = resolve_model_dir(config.model, getattr(torch, load_dtype), config.cache_dir)
    check_tp_shapes(AutoConfig.from_pretrained(model_dir), config.tensor_parallel_size)


def join_watching(join, follower_gone, name: str = "pdserve-tp-rendezvous"):
    """`join()` (the group's rendezvous) in a thread, failing at once when `follower_gone()` says a
    follower ended first (an import error, a bad model path, a failed device: its reason, else None)
    instead of after the rendezvous timeout. Used by this host's launcher and by Ray's TP workers."""
    import threading

    box: dict = {}

    def target():
        try:
            box["tp"] = join()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        why = follower_gone() if t.is_alive() else None
        if why:
            raise RuntimeError(f"tensor parallelism: {why} before the group formed")
    if "error" in box:
        raise box["error"]
    return box["tp"]


def _exited(procs) -> str | None:
    dead = [p for p in procs if p.exitcode is not None]
    return f"follower {dead[0].name} exited (code {dead[0].exitcode}; its log says why)" if dead else None


def _stop(procs, join_timeout_s: float) -> None:
    """Wait up to `join_timeout_s` for the followers to leave (they got Shutdown), then kill the rest."""
    for p in procs:
        p.join(join_timeout_s)
        if p.is_alive():
            logger.warning("TP follower %s did not stop in %.0f s; killing it", p.name, join_timeout_s)
            p.kill()
            p.join(5.0)
