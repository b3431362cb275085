"""benchmarks/gpu_engine.py end to end on the CPU at tiny settings: this tree against a `git archive HEAD`
of it (`--old-tree`), both trees' rows in the JSON, with positive numbers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A smoke run of a benchmark script (two processes importing torch and transformers, ~90 s on 2 cores).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 2)


def small_tokenizer(path: Path) -> str:
    """A 512-token word-level tokenizer, saved: the benchmark only needs ids, EOS and decode (SmolLM2's
    tokenizer is read from its GGUF file, ~20 s on a busy 2-core host)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str, Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs this checkout's git for `git archive HEAD`")
    tmp = tmp_path_factory.mktemp("gpu_engine")
    old = tmp / "old"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    out = tmp / "report.json"
    env = dict(os.environ, PDSERVE_TEST_TOKENIZER=small_tokenizer(tmp / "tok"), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONPATH="")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_engine.py"), "--device", "cpu", "--shapes", "tiny",
           "--batches", *map(str, BATCHES), "--steps", "2", "--warm-steps", "1", "--profile-steps", "1",
           "--burst-requests", "4", "--burst-prompt", "16", "40", "--burst-output", "3", "6", "--hf-new-tokens", "4",
           "--max-batched-tokens", "256", "--kv-cache-mb", "32", "--old-tree", str(old), "--json", str(out),
           "--budget-s", "200"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, old


def test_both_trees_have_every_row(report):
    result, _, old_dir = report
    assert result["old"]["engine_path"] == str((old_dir / "engine").resolve())  # the worker ran the old tree
    assert result["new"]["engine_path"] == str(ROOT / "engine")
    for tree in ("new", "old"):
        rows = result[tree]
        assert rows["errors"] == [] and rows["skipped"] == [], rows["errors"]
        assert sorted(r["batch"] for r in rows["decode"]) == list(BATCHES)
        for r in rows["decode"]:
            assert r["shape"] == "tiny" and r["full_batch"], r
            for key in ("step_wall_ms", "busy_ms", "output_tok_s", "profiled_wall_ms"):
                assert r[key] > 0, (tree, key, r)
            assert r["busy_ms"] <= r["profiled_wall_ms"]  # a union of intervals inside the profiled steps
            assert r["output_tok_s"] == pytest.approx(r["batch"] * 1e3 / r["step_wall_ms"])
            assert r["kernel_launches"] == 0 and r["host_syncs"] is None  # CPU: no CUDA calls to count
        (burst,) = rows["burst"]
        assert burst["complete"] and burst["requests"] == 4 and burst["output_tokens"] > 0
        assert burst["output_tok_s"] > 0 and burst["mean_step_ms"] > 0


def test_baselines_and_table(report):
    result, stdout, _ = report
    assert result["old"].get("baselines") == []  # baselines run in this tree's process only
    by_name = {b["name"]: b for b in result["new"]["baselines"]}
    assert by_name["HF generate, static cache"]["ms_per_token"] > 0
    cb = by_name["HF continuous batching"]
    assert cb["output_tokens"] == cb["requested_tokens"] and cb["output_tok_s"] > 0
    assert "| tiny | 1 | new/old |" in stdout and "| model shapes | batch | tree |" in stdout
