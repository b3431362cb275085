"""engine/thread_team.py: only the stepping thread opens OpenMP teams, and the outputs do not change."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, thread_team

ROOT = Path(__file__).resolve().parents[2]

needs_gomp = pytest.mark.skipif(thread_team.gomp() is None, reason="torch does not run on GNU OpenMP here")


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()))
    t.start()
    t.join(60)
    return box["r"]


@needs_gomp
def test_one_team_per_process():
    """In a fresh process: the thread that built the engine lets its OpenMP workers go, the owner's
    team has its threads, and other threads' torch ops add no OS threads (no second team)."""
    script = textwrap.dedent("""
        import os, threading, time, torch
        from engine import thread_team
        torch.set_num_threads(2)
        def n_threads():
            return len(os.listdir("/proc/self/task"))
        a = torch.randn(512, 512)
        base = n_threads()
        (a @ a).sum()                      # the main thread opens a team: one worker thread more
        with_team = n_threads()
        team = thread_team.confine("cpu", 2)
        assert team is not None
        for _ in range(100):               # its worker exits
            if n_threads() < with_team:
                break
            time.sleep(0.01)
        confined = n_threads()
        counts = {}
        ready, done = threading.Event(), threading.Event()
        def owner():
            team.own()
            counts["owner"] = torch.get_num_threads()
            (a @ a).sum()
            ready.set()
            done.wait(30)
        t = threading.Thread(target=owner); t.start(); ready.wait(30)
        with_owner = n_threads()           # the owner's thread and its worker
        (a @ a).sum()                      # main thread again: one thread now, no team
        def other():
            counts["other"] = torch.get_num_threads()
            (a @ a).sum()
        o = threading.Thread(target=other); o.start(); o.join(30)
        for _ in range(100):               # the other thread's OS thread goes a moment after join
            if n_threads() <= with_owner:
                break
            time.sleep(0.01)
        after = n_threads()
        done.set(); t.join(30)
        print(base, with_team, confined, with_owner, after, counts["owner"], counts["other"], torch.get_num_threads())
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    base, with_team, confined, with_owner, after, owner, other, main = map(int, out.stdout.split())
    assert with_team == base + 1, out.stdout
    assert confined == base, out.stdout
    assert with_owner == base + 2, out.stdout  # owner thread + its one worker
    assert after == with_owner, out.stdout     # the main and the other thread opened no team
    assert (owner, other, main) == (2, 1, 1)


def test_not_confined_off_cpu_or_without_gomp(monkeypatch):
    n = torch.get_num_threads()
    assert thread_team.confine("meta", 4) is None  # not a CPU engine
    assert torch.get_num_threads() == n
    monkeypatch.setattr(thread_team, "gomp", lambda: None)
    assert thread_team.confine("cpu", 4) is None
    assert torch.get_num_threads() == n


@needs_gomp
def test_owned_thread_gives_the_same_greedy_tokens(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, max_model_len=200, num_threads=2)
    prompts = [[100 + i for i in range(40)], [7, 8, 9, 10] * 9]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    team = thread_team.confine("cpu", None)  # None: the count torch had (2)
    try:
        assert team == thread_team.Team(num_threads=2, process_threads=2)
        assert torch.get_num_threads() == 1

        def step_owned():
            team.own()
            assert torch.get_num_threads() == 2
            return [o.token_ids for o in llm.generate(prompts, params)]

        assert _in_thread(step_owned) == ref
        assert torch.get_num_threads() == 1
    finally:
        team.give_back()
    assert torch.get_num_threads() == 2
