"""Each node resolves the model spec itself: a process that only tokenizes (the HTTP ingress) gets the
same tokenizer and chat template as the workers without the weights or a worker's converted copy.
No bed needed: the node is this process, with a cache directory of its own."""

from __future__ import annotations

import torch

from engine.model_loader import load_tokenizer, resolve_model_dir

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _same(a, b) -> None:
    assert a.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True) == \
        b.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert a("Grüße, 12345 tokens")["input_ids"] == b("Grüße, 12345 tokens")["input_ids"]
    assert (len(a), a.eos_token_id) == (len(b), b.eos_token_id)


def test_default_model_tokenizer_on_a_node_that_never_converted_it(tmp_path):
    from transformers import AutoTokenizer

    workers = AutoTokenizer.from_pretrained(resolve_model_dir(None, torch.float32))  # a worker's converted copy
    fresh = tmp_path / "cache"
    _same(load_tokenizer(None, cache_dir=str(fresh)), workers)
    assert not fresh.exists()  # read from the GGUF file: nothing converted, nothing written


def test_directory_model_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    path = tiny_model_dir("llama")
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))
