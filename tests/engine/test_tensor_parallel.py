"""Tensor parallelism on a CPU (gloo, world 2): greedy output equals transformers' `generate` and the
one-device engine token for token, for llama, qwen3 (padded vocab) and qwen2 (q/k/v bias, tied
embeddings, one KV head replicated on both ranks); chunked prefill, staggered arrivals, speculative
decoding, prefix caching, prompt logprobs and structured outputs under TP; bad sizes refused naming the
field; followers stop when rank 0 closes or dies.

Most tests run the follower rank as a thread of this process (`run_follower` as a Ray actor or a
spawned process would call it; one process saves the spawn and the imports); the last two spawn real
processes through `launch_local` and the offline `LLM`."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine import model_setup
from engine.errors import EngineConfigError
from engine.model_runner import ModelRunner
from engine.models.sharding import ShardLayout, check_tp_shapes
from engine.parallel import TPGroup, launch_local, leader_store, run_follower
from engine.parallel import worker as parallel_worker
from engine.structured import StructuredSpec
from test_correctness import hf_greedy, make_prompts
from test_speculative import looping_prompts

MAX_NEW = 12
BASE = dict(dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=32)


def make_model(base_dir: str, path: str, max_shard_size: str | None = None, **overrides) -> str:
    """A random-weight variant of the tiny model in `base_dir` (tests/conftest.py) with config overrides
    (vocab size, KV heads, tied embeddings), saved to `path` (safetensors) with the same tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(base_dir)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if not cfg.tie_word_embeddings:
        with torch.no_grad():  # as conftest's: a larger logit spread, fewer near-ties
            model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(path)
    return path


def hf_model(path: str):
    """The oracle: transformers' own model (a TP engine keeps only its shards of the HF modules)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class ThreadGroup:
    """Rank 0's engine in this thread, rank 1 a follower thread (`run_follower`)."""

    def __init__(self, path: str, **cfg):
        config = EngineConfig(model=path, tensor_parallel_size=2, **{**BASE, **cfg})
        store, init_method = leader_store(2)
        self.result: dict = {}
        self.thread = threading.Thread(
            target=lambda: self.result.update(stop=run_follower(config, 1, 2, init_method, 30.0)), daemon=True)
        self.thread.start()
        self.engine = LLMEngine(config, tp_group=TPGroup.connect(0, 2, init_method, "cpu", 30.0, store=store))

    def close(self) -> None:
        self.engine.close()
        self.thread.join(30)
        assert not self.thread.is_alive() and self.result["stop"] == "shutdown"


def run(engine: LLMEngine, prompts, params: SamplingParams | list[SamplingParams], arrive_every: int = 2):
    """Requests arriving `arrive_every` steps apart; {request id: final output (with its prompt logprobs)}.
    The blocks are all back after."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    pending, outs, step, prompt_logprobs = list(enumerate(prompts)), {}, 0, {}
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params[i])
        for out in engine.step():
            if out.prompt_logprobs is not None:  # sent once, with the request's first output
                prompt_logprobs[out.request_id] = out.prompt_logprobs
            if out.finished:
                out.prompt_logprobs = prompt_logprobs.get(out.request_id)
                outs[out.request_id] = out
        step += 1
        assert step < 5000
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    return outs


def assert_greedy_matches(hf, engine: LLMEngine, prompts, outs, max_new: int = MAX_NEW) -> None:
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"].token_ids == hf_greedy(hf, p, max_new, engine.eos_token_ids), f"prompt {i} differs"


GREEDY = dict(max_tokens=MAX_NEW, temperature=0)


# ---------------------------------------------------------------------------- refused sizes
@pytest.mark.parametrize("bad", [0, -1, True, "2", 1.5])
def test_bad_tensor_parallel_size_is_refused_naming_the_field(bad):
    with pytest.raises(EngineConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=bad)


def test_sizes_the_model_cannot_split_are_refused_naming_the_fields(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")  # 4 heads, 2 KV heads, intermediate 128

    def no_rendezvous(*args, **kwargs):
        raise AssertionError("a group was started for a size the model cannot split")

    # Refused before any follower process or rendezvous (no wait for a group that cannot form).
    monkeypatch.setattr(parallel_worker, "leader_store", no_rendezvous)
    with pytest.raises(EngineConfigError, match="tensor_parallel_size=3 must divide the model's num_attention_heads=4"):
        launch_local(EngineConfig(model=path, tensor_parallel_size=3, **BASE))
    cfg = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, intermediate_size=128)
    with pytest.raises(EngineConfigError, match="num_key_value_heads=3"):
        check_tp_shapes(cfg, 2)
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=4, intermediate_size=130)
    with pytest.raises(EngineConfigError, match="intermediate_size=130"):
        check_tp_shapes(cfg, 4)
    with pytest.raises(EngineConfigError, match="tensor_parallel_size=2 needs its follower ranks"):
        LLMEngine(EngineConfig(model=path, tensor_parallel_size=2, **BASE))


def test_kv_heads_fewer_than_ranks_are_replicated_to_the_ranks_whose_q_heads_use_them():
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64)
    group = 8 // 2  # q heads per KV head
    layouts = [ShardLayout.of(cfg, 4, r) for r in range(4)]
    assert [(l.head0, l.num_heads, l.kv_head0, l.num_kv_heads) for l in layouts] == [
        (0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    for l in layouts:  # every q head of a rank reads the KV head that rank keeps
        assert {h // group for h in range(l.head0, l.head0 + l.num_heads)} == {l.kv_head0}
    split = [ShardLayout.of(cfg, 2, r) for r in range(2)]
    assert [(l.kv_head0, l.num_kv_heads) for l in split] == [(0, 1), (1, 1)]


# ---------------------------------------------------------------------------- llama, one group for several tests
@pytest.fixture(scope="module")
def llama_tp(tiny_model_dir):
    group = ThreadGroup(tiny_model_dir("llama"), speculative_method="ngram", speculative_adaptive=False)
    yield group
    group.close()


@pytest.fixture(scope="module")
def llama_hf(tiny_model_dir):
    return hf_model(tiny_model_dir("llama"))


def test_tp2_keeps_half_the_kv_heads_and_reads_only_its_slices(llama_tp, llama_hf):
    engine = llama_tp.engine
    runner = engine.runner
    assert runner.kv_cache.shape[-2] == 1 and runner.num_heads == 2  # of 2 KV heads and 4 q heads
    cfg = llama_hf.config
    assert ModelRunner.kv_block_bytes(cfg, 4, torch.float32, 2) * 2 == ModelRunner.kv_block_bytes(cfg, 4, torch.float32)
    assert runner.model.lin_qkv[0].weight.shape[0] == (2 + 1 + 1) * 16  # 2 q heads, its K and V head
    assert runner.model.embed_tokens.weight.shape[0] == engine.vocab_size // 2
    # Read from safetensors: the HF model's projections never held the whole weights (meta placeholders).
    attn = engine.hf_model.model.layers[0].self_attn
    assert attn.q_proj.weight.device.type == "meta" and engine.hf_model.lm_head.weight.device.type == "meta"
    assert engine.hf_model.model.norm.weight.device.type == "cpu"  # replicated ones are real


def test_tp2_greedy_matches_hf_with_staggered_arrivals_and_chunked_prefill(llama_tp, llama_hf):
    engine = llama_tp.engine
    prompts = make_prompts(6, engine.vocab_size, seed=1)  # up to 50 tokens: 2 chunks of the 32-token budget
    outs = run(engine, prompts, SamplingParams(**GREEDY, speculative=False))
    assert_greedy_matches(llama_hf, engine, prompts, outs)


def test_tp2_speculative_decoding_matches_hf(llama_tp, llama_hf):
    engine = llama_tp.engine
    before = engine.spec_stats().num_accepted
    prompts = looping_prompts(engine.vocab_size, seed=32)[:3]
    outs = run(engine, prompts, SamplingParams(max_tokens=40, temperature=0), arrive_every=3)
    assert_greedy_matches(llama_hf, engine, prompts, outs, 40)
    assert engine.spec_stats().num_accepted > before  # verify steps (several rows a sequence) ran under TP


def test_tp2_prefix_cache_hits_match_hf(llama_tp, llama_hf):
    engine = llama_tp.engine
    rng = random.Random(5)
    shared = [rng.randrange(3, engine.vocab_size) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (1, 5, 9)]
    outs = run(engine, prompts, SamplingParams(**GREEDY, speculative=False), arrive_every=4)
    assert_greedy_matches(llama_hf, engine, prompts, outs)
    assert [outs[f"r{i}"].num_cached_tokens for i in range(3)] == [0, 28, 28]


def test_tp2_prompt_logprobs_and_structured_outputs_equal_one_device(llama_tp, tiny_model_dir):
    tp2 = llama_tp.engine
    tp1 = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), **BASE))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 200, 300, 400, 500]]
    spec = StructuredSpec("choice", '["red", "green", "blue"]')
    params = [SamplingParams(**GREEDY, prompt_logprobs=2, logprobs=2),
              SamplingParams(max_tokens=8, temperature=0, structured=spec)]
    got, want = run(tp2, prompts, params), run(tp1, prompts, params)
    for rid in ("r0", "r1"):
        assert got[rid].token_ids == want[rid].token_ids and got[rid].text == want[rid].text
    assert got["r1"].text in ("red", "green", "blue")
    a, b = got["r0"].prompt_logprobs, want["r0"].prompt_logprobs
    assert len(a) == len(b) == len(prompts[0]) and a[0] is None and b[0] is None  # the first token: no logprob
    for x, y in zip(a[1:], b[1:]):  # row-parallel sums change the last bits only
        assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-3)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


# ---------------------------------------------------------------------------- other shapes
def test_qwen3_tp2_with_a_padded_vocab_matches_hf(tiny_model_dir, tmp_path):
    # An odd vocab (one less than the tokenizer's): each rank holds 24576 rows, rank 1's last one padding.
    base = tiny_model_dir("qwen3")
    # Saved in several safetensors files with an index, as large checkpoints are.
    path = make_model(base, str(tmp_path / "qwen3"), max_shard_size="2MB",
                      vocab_size=len(AutoTokenizer.from_pretrained(base)) - 1)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    group = ThreadGroup(path)
    try:
        engine = group.engine
        assert engine.vocab_size % 2 == 1
        prompts = make_prompts(4, engine.vocab_size, seed=7)
        outs = run(engine, prompts, SamplingParams(**GREEDY))
        assert_greedy_matches(hf_model(path), engine, prompts, outs)
    finally:
        group.close()


def test_qwen2_bias_tied_embeddings_and_one_kv_head_replicated_match_hf(tiny_model_dir, tmp_path, monkeypatch):
    # The other path: each rank loads the HF model whole (as a swapped-in loader gives it) and slices its
    # modules, instead of reading only its slices from the safetensors files.
    path = make_model(tiny_model_dir("qwen2"), str(tmp_path / "qwen2"), num_key_value_heads=1,
                      tie_word_embeddings=True)
    monkeypatch.setattr(model_setup.SafetensorsTensors, "available", staticmethod(lambda model_dir: False))
    group = ThreadGroup(path)
    try:
        engine = group.engine
        assert engine.runner.kv_cache.shape[-2] == 1 and engine.runner.model.lin_qkv[0].bias is not None
        prompts = make_prompts(4, engine.vocab_size, seed=8)
        outs = run(engine, prompts, SamplingParams(**GREEDY))
        assert_greedy_matches(hf_model(path), engine, prompts, outs)
    finally:
        group.close()


# ---------------------------------------------------------------------------- real processes
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def test_offline_llm_spawns_followers_matches_hf_and_close_stops_them(tiny_model_dir, llama_hf):
    path = tiny_model_dir("llama")
    prompts = make_prompts(3, llama_hf.config.vocab_size, seed=9)
    with LLM(path, tensor_parallel_size=2, **BASE) as llm:
        pids = list(llm.engine.follower_pids)
        assert len(pids) == 1 and not _gone(pids[0])
        outs = llm.generate(prompts, SamplingParams(**GREEDY))
        for p, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(llama_hf, p, MAX_NEW, llm.engine.eos_token_ids)
        llm.engine.check_integrity()
    assert _wait_gone(pids, 30)


RANK0_SCRIPT = """
import sys, time
from engine import EngineConfig, SamplingParams
from engine.parallel import launch_local
engine = launch_local(EngineConfig(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", num_kv_blocks=32,
                                   block_size=4), timeout_s=120)
engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
while engine.has_unfinished_requests():
    engine.step()
print("followers", *engine.follower_pids, flush=True)
time.sleep(600)  # killed by the test
"""


@pytest.mark.slow
def test_a_follower_stops_when_rank0_is_killed(tiny_model_dir, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tmp_path / "rank0.log"
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, tiny_model_dir("llama")], env=env,
                             stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    try:
        line = ""
        deadline = time.monotonic() + 240
        while not line.startswith("followers") and time.monotonic() < deadline and rank0.poll() is None:
            line = rank0.stdout.readline()
        assert line.startswith("followers"), f"rank 0 did not come up: {log.read_text()[-3000:]}"
        pids = [int(p) for p in line.split()[1:]]
    finally:
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(10)
    # Its store's connection breaks: the follower's pending wait (30 s long) fails at once (~3 s to exit here).
    assert _wait_gone(pids, 30), f"the follower outlived rank 0: {log.read_text()[-3000:]}"


# ---------------------------------------------------------------------------- CUDA (NCCL), one GPU a rank
def num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# NOTE: NCCL cannot put two ranks of one group on one device; scripts/gpu_check.sh runs these (and
# tests/kv_transfer/test_tp_kv.py's) on its "tp" part only where it finds two GPUs or more.
TWO_GPUS = pytest.mark.skipif(num_gpus() < 2, reason=f"tensor parallelism on CUDA needs >= 2 GPUs, one a rank "
                                                     f"(found {num_gpus()})")


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("speculative_method", ["off", "ngram"])
def test_tp2_on_two_gpus_over_nccl_matches_hf(tiny_model_dir, speculative_method):
    """Ranks 0 and 1 on GPUs 0 and 1 (spawned processes, a ProcessGroupNCCL): greedy output equals
    transformers' fp32 generate on GPU 0, with speculative verification steps or without; the
    followers end when the engine closes."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda:0").eval()
    prompts = make_prompts(4, hf.config.vocab_size, seed=21) + looping_prompts(hf.config.vocab_size, seed=32)[:2]
    with LLM(path, tensor_parallel_size=2, device="cuda", speculative_method=speculative_method,
             **BASE) as llm:
        pids = list(llm.engine.follower_pids)
        assert llm.engine.runner.kv_cache.device == torch.device("cuda:0")
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
        for i, (p, out) in enumerate(zip(prompts, outs)):
            assert out.token_ids == hf_greedy(hf, p, 24, llm.engine.eos_token_ids), f"prompt {i} differs"
        if speculative_method != "off":
            assert llm.engine.spec_stats().num_accepted > 0
        llm.engine.check_integrity()
    assert _wait_gone(pids, 60)
