"""KVExporter ends leases without waiting for the engine: a push acked while the prefill loop is mid-step
returns at once, and the blocks are freed by the next holder of the engine lock."""

from __future__ import annotations

import threading

from deployments.cluster.kv_endpoint import KVExporter
from engine import EngineConfig, LLMEngine, SamplingParams


def _prefilled(eng: LLMEngine, rid: str):
    eng.add_request(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0), prefill_only=True)
    while True:
        for out in eng.step():
            if out.finished:
                return out


def test_release_does_not_wait_for_a_busy_engine(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=32, block_size=4))
    lock = threading.RLock()
    exporter = KVExporter("p0", eng, engine_lock=lock, host="127.0.0.1")
    try:
        handle = exporter.grant(_prefilled(eng, "r1"), 5)
        assert eng.block_manager.num_used_blocks == 2

        stepping, done = threading.Event(), threading.Event()

        def busy_loop():  # the worker's loop holding the lock for a long step
            with lock:
                stepping.set()
                done.wait(10)

        t = threading.Thread(target=busy_loop)
        t.start()
        stepping.wait(5)
        assert exporter.release("r1", handle.epoch)  # e.g. the receiver's ack
        assert t.is_alive()  # returned while the busy step still holds the lock: it did not wait for it
        assert eng.block_manager.num_used_blocks == 2  # not yet: the engine is busy
        done.set()
        t.join(5)
        assert exporter.free_released() == 1
        assert eng.block_manager.num_used_blocks == 0
        eng.check_integrity()

        # Idle engine: freed at once, and a request id can be prefilled again right after.
        handle = exporter.grant(_prefilled(eng, "r1"), 5)
        assert exporter.release("r1", handle.epoch)
        assert eng.block_manager.num_used_blocks == 0
        exporter.grant(_prefilled(eng, "r1"), 5)
        exporter.leases.release_all()
        exporter.free_released()
        eng.check_integrity()
        assert eng.block_manager.num_used_blocks == 0
    finally:
        exporter.close()
