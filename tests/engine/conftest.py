"""Engine test fixtures: tiny models on machines without the default model.

A GPU machine may lack the default model package (its GGUF file is the source of the tiny models'
tokenizer, see tests/conftest.py): `PDSERVE_TEST_TOKENIZER` names a directory holding SmolLM2's
tokenizer (saved with `save_pretrained`), and the tiny models then take it from there. They are the
same models either way (same configs, same seeds, the same tokenizer).
"""

from __future__ import annotations

import os
from unittest import mock

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dir):
    """tests/conftest.py's factory, with the tokenizer from `PDSERVE_TEST_TOKENIZER` when that is set."""
    tokenizer_dir = os.environ.get("PDSERVE_TEST_TOKENIZER")
    if not tokenizer_dir:
        return tiny_model_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    make = tiny_model_dir

    def get(model_type: str = "llama") -> str:
        # The root factory loads the default model only for its tokenizer, through the loader it
        # imports when it runs: that one call gets the tokenizer saved in `tokenizer_dir` instead.
        with mock.patch("engine.model_loader.load_model_and_tokenizer",
                        return_value=(None, tokenizer, tokenizer_dir)):
            return make(model_type)

    return get


@pytest.fixture(autouse=True)
def _integrity(request):
    """After every test that used an `llm` fixture: its engine's block accounting holds and it holds
    no blocks (nothing leaks, whatever the test did)."""
    yield
    if "llm" in request.fixturenames:
        eng = request.getfixturevalue("llm").engine
        eng.check_integrity()
        assert eng.block_manager.num_used_blocks == 0
