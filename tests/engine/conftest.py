"""Engine test fixtures: every test that used an `llm` fixture leaves its engine's blocks whole and free.
(Tiny models on a machine without the default model: tests/conftest.py, `PDSERVE_TEST_TOKENIZER`.)"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _integrity(request):
    """After every test that used an `llm` fixture: its engine's block accounting holds and it holds
    no blocks (nothing leaks, whatever the test did)."""
    yield
    if "llm" in request.fixturenames:
        eng = request.getfixturevalue("llm").engine
        eng.check_integrity()
        assert eng.block_manager.num_used_blocks == 0
