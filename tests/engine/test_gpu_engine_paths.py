"""The GPU engine's paths, checked on the CPU where a CPU can: the Triton backend (in Triton's
interpreter) end to end against transformers, the CUDA-graph ladder and its padded inputs (replayed
eagerly off CUDA over the same static buffers), and the ops backends' choice. On a GPU (`gpu` marker)
the same engine runs with real CUDA graphs and is checked against its eager self and transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cuda_graphs import StagingLayout, capture_sizes, padded_size
from engine.errors import EngineConfigError
from engine.ops.base import HostStep
from test_correctness import check_against_hf, make_prompts
from test_speculative import looping_prompts

pytest.importorskip("triton")
_CUDA = torch.cuda.is_available()


def test_capture_ladder_is_1_2_4_then_steps_of_8_up_to_max_num_seqs():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1) == [1] and capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(100)[-2:] == [96, 104]  # the last size holds max_num_seqs
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert padded_size(65, sizes) is None


def _host_step(seqs: list[tuple[int, int, list[int]]], block_size: int) -> HostStep:
    """(context length before, query rows, block table) per sequence -> a HostStep of decode/verify rows."""
    ids, pos, blocks, qlens, lens, tables = [], [], [], [], [], []
    for start, n, table in seqs:
        ids += [7] * n
        pos += list(range(start, start + n))
        blocks += [table[p // block_size] for p in range(start, start + n)]
        qlens.append(n)
        lens.append(start + n)
        tables.append(table)
    rows = list(range(len(ids)))
    return HostStep(ids, pos, blocks, rows, rows, [], [], [], [], qlens, lens, tables)


def test_staging_layout_pads_rows_and_sequences_so_they_write_and_read_nothing():
    bs = 4
    hs = _host_step([(5, 1, [3, 9]), (2, 3, [4, 1])], bs)  # a decode row, then a verify span of 3 rows
    layout = StagingLayout(batch=4, query_len=3, width=5)
    buf = np.full(layout.size, 99, dtype=np.int64)
    layout.fill(buf, hs, bs)
    t = layout.num_rows
    assert list(buf[layout.ids:layout.ids + t]) == [7, 7, 7, 7] + [0] * 8
    assert list(buf[layout.pos:layout.pos + 4]) == [5, 2, 3, 4]
    slots = list(buf[layout.slots:layout.slots + t])
    assert slots[:4] == [9 * bs + 1, 4 * bs + 2, 4 * bs + 3, 1 * bs + 0] and slots[4:] == [-1] * 8
    assert list(buf[layout.lens:layout.lens + 4]) == [6, 5, 0, 0]
    assert list(buf[layout.qsl:layout.qsl + 5]) == [0, 1, 4, 4, 4]  # padding sequences: no rows
    tables = buf[layout.tables:layout.tables + 4 * 5].reshape(4, 5)
    assert list(tables[0, :2]) == [3, 9] and list(tables[1, :2]) == [4, 1]


def test_unknown_ops_backend_is_refused_naming_the_field():
    with pytest.raises(EngineConfigError, match="ops_backend"):
        EngineConfig(ops_backend="cudnn")
    with pytest.raises(EngineConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


# NOTE: qwen3 (q/k norms) and the verify steps take ~45 and ~85 s in the CPU interpreter: `slow`; the llama
# case keeps the padded graph path in the default suite, and test_triton_kernels covers verify rows.
@pytest.mark.parametrize("model_type", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_triton_backend_matches_hf_through_padded_graph_steps(tiny_model_dir, model_type):
    """Prefill chunks (eager, mixed with decodes) and decode steps (the padded graph path) in Triton's
    interpreter: greedy tokens equal transformers' token for token."""
    device = "cuda" if _CUDA else "cpu"
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(model_type), device=device, dtype="float32",
                                    ops_backend="triton", num_kv_blocks=64, max_num_seqs=8,
                                    max_num_batched_tokens=48, enable_prefix_caching=False))
    assert engine.runner.ops.name == "triton" and engine.runner.graphs is not None
    kv_before = engine.runner.kv_cache.clone()
    check_against_hf(engine, make_prompts(3, engine.vocab_size, seed=3, lengths=(5, 30, 11)), max_new=8)
    assert engine.runner.graphs.num_replays > 0, "no decode step went through the padded graph path"
    used = sorted({b for b in range(64) if not torch.equal(engine.runner.kv_cache[b], kv_before[b])})
    # NOTE: padding rows carry slot -1: only blocks that real tokens were given can have changed.
    assert used and max(used) < 64 and len(used) <= 3 * -(-(30 + 8) // 16) + 3


@pytest.mark.slow
def test_triton_backend_speculative_verify_steps_match_hf(tiny_model_dir):
    """Steps that verify drafts replay the (B, 1 + k) graphs: greedy output is unchanged."""
    device = "cuda" if _CUDA else "cpu"
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device=device, dtype="float32",
                                    ops_backend="triton", num_kv_blocks=64, max_num_seqs=4,
                                    speculative_method="ngram", num_speculative_tokens=3,
                                    speculative_adaptive=False, enable_prefix_caching=False))
    prompts = looping_prompts(engine.vocab_size, seed=32)[:2]  # the tiny model loops on these: drafts
    check_against_hf(engine, prompts, max_new=24, arrive_every=1)
    assert engine.spec_stats().num_accepted > 0
    assert any(k[1] > 1 for k in engine.runner.graphs.graphs), "no verify step took the graph path"


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_cuda_graph_replays_equal_eager_steps_on_the_gpu(tiny_model_dir):
    """Real CUDA graphs against the same engine run eagerly: same greedy tokens, in bf16 too."""
    prompts = make_prompts(6, 1000, seed=5)
    outs = {}
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cuda", dtype="bfloat16",
                                        cuda_graphs=graphs, num_kv_blocks=256, max_num_seqs=8,
                                        enable_prefix_caching=False))
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        got = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    got[o.request_id] = o.token_ids
        outs[graphs] = got
        if graphs:
            assert engine.runner.graphs.num_replays > 0
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_one_host_sync_per_decode_step_with_penalties_logprobs_and_a_grammar(tiny_model_dir):
    from engine.structured import StructuredSpec
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cuda", dtype="bfloat16",
                                    num_kv_blocks=256, max_num_seqs=8, enable_prefix_caching=False))
    plain = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    rich = SamplingParams(max_tokens=40, temperature=0.7, top_k=20, repetition_penalty=1.2,
                          frequency_penalty=0.5, logprobs=3, seed=2, ignore_eos=True)
    engine.add_request("plain", [5, 6, 7], plain)
    engine.add_request("rich", [8, 9, 10, 11], rich)
    engine.add_request("json", [12, 13], SamplingParams(max_tokens=40, temperature=0,
                                                        structured=StructuredSpec("json_object")))
    for _ in range(3):  # past the prefills, into decode steps
        engine.step()
    from benchmarks.gpu_engine import host_syncs
    num_syncs, sites = host_syncs(engine)
    assert num_syncs <= 1, sites
