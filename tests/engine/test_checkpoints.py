"""Real-checkpoint loading (`--model /path`): tiny random-weight Llama / Mistral / Qwen2 / Qwen3
directories written here by transformers (safetensors, one of them sharded), each with SmolLM2's
tokenizer, must give transformers' own greedy `generate` token for token, with the features real
checkpoints use (RoPE scaling past the pretraining length, tied and untied embeddings, q/k/v and MLP
biases, q/k norms, an explicit head_dim, sliding windows, chat templates); bad directories are refused
before any weight is read, with an error naming the file or config field."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.errors import EngineConfigError, PromptTooLongError
from engine.model_loader import SUPPORTED_ROPE_TYPES, check_checkpoint, load_model_and_tokenizer, load_tokenizer
from engine.models import LlamaModel
from test_correctness import check_against_hf, hf_greedy, make_prompts, run_staggered

MAX_NEW = 12
# Weight gains over transformers' init (see build_checkpoint); test_features_change_the_tokens checks
# that the features under test move the tokens of these models.
QK_GAIN = 4.0
OUT_GAIN = 16.0
PROMPT_LENGTHS = (5, 40, 70, 130, 17, 200)  # past the scaled checkpoints' original 64 positions too
# A Llama-3-style chat template (not SmolLM2's own), to show the directory's template is the one used.
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# name -> (model_type, config overrides, save options). Every config: hidden 64, 4 heads over 2 KV heads,
# 2 layers, SmolLM2's vocab, 512 positions unless overridden. `hub_rope`: config.json spells RoPE as the
# hub's Llama-3.1 and Qwen2.5 files do (transformers 4.x: top-level rope_theta, a `rope_scaling` dict),
# not as transformers 5 saves it (`rope_parameters`).
CHECKPOINTS = {
    # Llama 3.1's rope: llama3 scaling over an original context of 64 (the prompts go past it).
    "llama3_rope": ("llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=64)), dict(hub_rope=True)),
    # Tied embeddings, biases on q/k/v/o and on the MLP (the MLP then runs as transformers' module).
    "llama_tied_bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                      rope_scaling=dict(rope_type="linear", factor=2.0)), {}),
    # Mistral-Nemo-style: head_dim 32, not hidden / heads = 16; no sliding window.
    "mistral_head_dim": ("mistral", dict(head_dim=32, sliding_window=None), {}),
    # Qwen2.5-style: q/k/v bias, tied embeddings, yarn over an original context of 64, sharded safetensors.
    "qwen2_yarn_sharded": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=False,
                                         rope_scaling=dict(type="yarn", factor=4.0,
                                                           original_max_position_embeddings=64)),
                           dict(max_shard_size="100KB", hub_rope=True)),
    # Qwen3: q/k RMSNorm, head_dim 32 (explicit, != 16), dynamic NTK rope (no-op within max positions).
    "qwen3_qk_norm": ("qwen3", dict(head_dim=32, use_sliding_window=False,
                                    rope_scaling=dict(rope_type="dynamic", factor=2.0)), {}),
}


def build_checkpoint(tokenizer, path: Path, model_type: str, overrides: dict, save: dict, seed: int = 0,
                     chat_template: str | None = None) -> str:
    """Save a random-weight model and `tokenizer` (SmolLM2's) under `path` as `save_pretrained` does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                pad_token_id=tokenizer.eos_token_id)
    spec.update(overrides)
    cfg = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        # transformers starts biases at 0 and norms at 1: random values, so a bias or norm the engine
        # skipped would change the tokens.
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.01)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        # Attention scores of O(1), not transformers' near-uniform ones at init, so the tokens depend on
        # the positions (RoPE); sublayer outputs larger than a token's own embedding, so a tied model
        # does not just predict its input token again.
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_GAIN)
            layer.self_attn.k_proj.weight.mul_(QK_GAIN)
            layer.self_attn.o_proj.weight.mul_(OUT_GAIN)
            layer.mlp.down_proj.weight.mul_(OUT_GAIN)
        # A wider logit spread (fewer near-ties between argmax candidates), through the final norm so a
        # tied embedding stays as it is.
        model.model.norm.weight.mul_(8.0)
    save = dict(save)
    hub_rope = save.pop("hub_rope", False)
    model.save_pretrained(str(path), **save)
    if hub_rope:
        saved = json.loads((path / "config.json").read_text())
        saved["rope_theta"] = saved.pop("rope_parameters")["rope_theta"]
        saved["rope_scaling"] = overrides["rope_scaling"]
        (path / "config.json").write_text(json.dumps(saved, indent=2))
    if chat_template is not None:
        tokenizer = copy.deepcopy(tokenizer)  # the session's tokenizer keeps its own template
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, test_tokenizer):
    """Factory: checkpoint(name) -> the directory of CHECKPOINTS[name], built once per module."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            model_type, overrides, save = CHECKPOINTS[name]
            template = LLAMA3_STYLE_TEMPLATE if name == "llama3_rope" else None
            built[name] = build_checkpoint(test_tokenizer, tmp_path_factory.mktemp(name), model_type, overrides, save,
                                           chat_template=template)
        return built[name]

    return get


def engine_for(path: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_kv_blocks", 160)
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=4, **kwargs))


def default_inv_freq(cfg) -> torch.Tensor:
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


# --------------------------------------------------------------------------- each checkpoint vs transformers
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoint_greedy_matches_hf(checkpoint, name):
    path = checkpoint(name)
    engine = engine_for(path)
    model_type, overrides, _ = CHECKPOINTS[name]
    cfg = engine.hf_model.config
    assert cfg.model_type == model_type
    assert engine.runner.head_dim == overrides.get("head_dim", 16)
    # Prompts past the rope-scaled models' original context of 64 positions, and short ones.
    prompts = make_prompts(6, engine.vocab_size, seed=11, lengths=PROMPT_LENGTHS)
    check_against_hf(engine, prompts, max_new=MAX_NEW)


def test_rope_scaling_reaches_the_model(checkpoint):
    """The scaled checkpoints really rotate differently from plain RoPE (else the tests above prove
    nothing about scaling): llama3 and yarn change the frequencies, yarn scales cos/sin too."""
    for name, rope_type in (("llama3_rope", "llama3"), ("qwen2_yarn_sharded", "yarn"), ("llama_tied_bias", "linear")):
        hf_model, _, path = load_model_and_tokenizer(checkpoint(name))
        assert check_checkpoint(path).rope_type == rope_type
        rotary = hf_model.model.rotary_emb
        assert not torch.allclose(rotary.inv_freq.float(), default_inv_freq(hf_model.config)), name
        if rope_type == "yarn":
            assert rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)


def _plain_rope(hf_model) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    plain = copy.deepcopy(hf_model.config)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": hf_model.config.rope_parameters["rope_theta"]}
    hf_model.model.rotary_emb = LlamaRotaryEmbedding(plain)


@torch.no_grad()
def _drop_biases_and_qk_norms(hf_model) -> None:
    for name, p in hf_model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif "q_norm" in name or "k_norm" in name:
            p.fill_(1.0)


@pytest.mark.parametrize("name, drop", [
    ("llama3_rope", _plain_rope), ("qwen2_yarn_sharded", _plain_rope), ("llama_tied_bias", _plain_rope),
    ("llama_tied_bias", _drop_biases_and_qk_norms), ("qwen2_yarn_sharded", _drop_biases_and_qk_norms),
    ("qwen3_qk_norm", _drop_biases_and_qk_norms)])
def test_features_change_the_tokens(checkpoint, name, drop):
    """Without its RoPE scaling, biases or q/k norms, a checkpoint's own greedy tokens change in
    transformers: the random models are sensitive to what test_checkpoint_greedy_matches_hf checks."""
    prompts = make_prompts(6, 49152, seed=11, lengths=PROMPT_LENGTHS)
    hf_model, _, _ = load_model_and_tokenizer(checkpoint(name))
    want = [hf_greedy(hf_model, p, MAX_NEW, frozenset()) for p in prompts]
    drop(hf_model)
    assert any(hf_greedy(hf_model, p, MAX_NEW, frozenset()) != w for p, w in zip(prompts, want))


@pytest.mark.parametrize("name", ["llama3_rope", "qwen2_yarn_sharded", "qwen3_qk_norm"])
def test_cos_sin_cache_equals_the_rotary_module(checkpoint, name):
    """The GPU kernels' table (`LlamaModel.cos_sin_cache`) holds what the HF rotary module gives at
    every position, past the original context included (scaling and yarn's attention factor in it)."""
    hf_model, _, _ = load_model_and_tokenizer(checkpoint(name))
    model = LlamaModel(hf_model, torch.device("cpu"))
    table = model.cos_sin_cache(300, torch.device("cpu"))
    half = model.head_dim // 2
    pos = torch.tensor([[0, 1, 63, 64, 65, 150, 299]])
    cos, sin = hf_model.model.rotary_emb(torch.empty(1, 1, model.head_dim), pos)
    torch.testing.assert_close(table[pos[0], :half], cos[0, :, :half].float())
    torch.testing.assert_close(table[pos[0], half:], sin[0, :, :half].float())


@pytest.mark.slow  # ~1.5 min each in Triton's interpreter on a CPU
@pytest.mark.parametrize("name", ["llama3_rope", "qwen2_yarn_sharded"])
def test_scaled_rope_through_the_triton_kernels(checkpoint, name):
    """The GPU path (Triton's fused RoPE + KV store reading `cos_sin_cache`; the interpreter on a CPU)
    past the original context: greedy tokens equal transformers'."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(EngineConfig(model=checkpoint(name), device=device, dtype="float32", ops_backend="triton",
                                    num_kv_blocks=64, block_size=16, max_num_seqs=4, enable_prefix_caching=False))
    assert engine.runner.ops.name == "triton" and engine.runner.cos_sin is not None
    check_against_hf(engine, make_prompts(2, engine.vocab_size, seed=13, lengths=(70, 9)), max_new=6)


def test_sharded_checkpoint_loads_every_shard(checkpoint):
    path = Path(checkpoint("qwen2_yarn_sharded"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    info = check_checkpoint(str(path))
    assert sorted(info.weight_files) == shards
    hf_model, _, _ = load_model_and_tokenizer(str(path))
    assert hf_model.config.tie_word_embeddings
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert hf_model.model.layers[1].self_attn.q_proj.bias.abs().sum() > 0  # loaded, not initialised to 0


def test_untied_embeddings_stay_separate(checkpoint):
    hf_model, _, _ = load_model_and_tokenizer(checkpoint("llama3_rope"))
    assert not hf_model.config.tie_word_embeddings
    assert not torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)


def test_chat_template_from_the_directory(checkpoint):
    """The engine's chat path renders the directory's own template (here a Llama-3-style one, not
    SmolLM2's), and the rendered prompt generates as transformers does."""
    engine = engine_for(checkpoint("llama3_rope"))
    assert engine.tokenizer.chat_template == LLAMA3_STYLE_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    ids = engine.apply_chat_template(messages)
    text = engine.tokenizer.decode(ids)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "<|eot_id|>" in text
    assert ids == engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    got = run_staggered(engine, [ids, ids[:-3]], MAX_NEW)
    assert got["r0"] == hf_greedy(engine.hf_model, ids, MAX_NEW, engine.eos_token_ids)
    assert load_tokenizer(checkpoint("llama3_rope")).chat_template == LLAMA3_STYLE_TEMPLATE  # the ingress' path


# --------------------------------------------------------------------------- sliding windows
def test_sliding_window_caps_the_context(test_tokenizer, tmp_path):
    """Mistral-7B-v0.1-style: sliding_window below max_position_embeddings. The paged attention has no
    window, so the context is capped at it, where a window attends to everything; the tokens equal
    transformers' (which applies the window) up to that length, and a longer prompt is refused."""
    path = build_checkpoint(test_tokenizer, tmp_path / "m", "mistral", dict(sliding_window=48), {})
    assert check_checkpoint(path).sliding_window == 48
    engine = engine_for(path, max_model_len=400)
    assert engine.max_model_len == 48
    prompts = make_prompts(4, engine.vocab_size, seed=12, lengths=(5, 20, 30, 35))
    check_against_hf(engine, prompts, max_new=MAX_NEW)
    with pytest.raises(PromptTooLongError, match="48"):
        engine.add_request("long", list(range(3, 51)))


def test_qwen_sliding_window_off_is_full_context(test_tokenizer, tmp_path):
    """Qwen2.5's configs carry a sliding_window with use_sliding_window false: full attention; turned on,
    the context is capped at the window."""
    path = build_checkpoint(test_tokenizer, tmp_path / "q", "qwen2", dict(use_sliding_window=False, sliding_window=32), {})
    assert check_checkpoint(path).sliding_window is None
    assert engine_for(path).max_model_len == 512
    on = json.loads((Path(path) / "config.json").read_text())
    on.update(use_sliding_window=True, sliding_window=32, max_window_layers=1)  # layer 1 slides
    (Path(path) / "config.json").write_text(json.dumps(on))
    assert check_checkpoint(path).sliding_window == 32
    assert engine_for(path).max_model_len == 32


# --------------------------------------------------------------------------- refused directories
@pytest.fixture(scope="module")
def good_dir(checkpoint):
    return Path(checkpoint("mistral_head_dim"))


def broken_copy(good_dir: Path, tmp_path: Path, drop=(), config_edit=None) -> str:
    """A copy of `good_dir` without the files in `drop` and with config.json edited by `config_edit`.
    The weights are not copied when the test must fail before reading them (a dangling name is enough)."""
    out = tmp_path / "broken"
    out.mkdir()
    for f in good_dir.iterdir():
        if f.name not in drop:
            shutil.copy(f, out / f.name)
    if config_edit is not None and (out / "config.json").exists():
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def refused(path: str, *fragments: str) -> None:
    """Both the engine's loader and the ingress' tokenizer loader refuse `path`, naming `fragments`."""
    for load in (load_model_and_tokenizer, load_tokenizer):
        with pytest.raises(EngineConfigError) as err:
            load(path)
        for fragment in fragments:
            assert fragment in str(err.value), (load.__name__, str(err.value))


@pytest.mark.parametrize("edit, fragments", [
    (lambda c: c.update(model_type="gemma2"), ("model_type='gemma2'", "llama", "qwen3")),
    (lambda c: c.update(model_type="mixtral"), ("model_type='mixtral'", "mistral (MistralForCausalLM)")),
    (lambda c: c.update(architectures=["MistralForSequenceClassification"]), ("architectures=",)),
    (lambda c: c.update(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 16, long_factor=[2.0] * 16,
                                          original_max_position_embeddings=64)),
     ("rope_scaling.rope_type='longrope'", *SUPPORTED_ROPE_TYPES)),
    (lambda c: c.update(rope_parameters=dict(rope_type="su", rope_theta=10000.0)), ("rope_parameters.rope_type='su'",)),
    (lambda c: c.update(partial_rotary_factor=0.5), ("partial_rotary_factor=0.5",)),
    (lambda c: c.update(quantization_config=dict(quant_method="awq", bits=4)), ("quantization_config (awq)",)),
])
def test_bad_config_names_the_field(good_dir, tmp_path, edit, fragments):
    refused(broken_copy(good_dir, tmp_path, config_edit=edit), *fragments)


def test_missing_config(good_dir, tmp_path):
    path = broken_copy(good_dir, tmp_path, drop=("config.json",))
    (Path(path) / "params.json").write_text("{}")
    refused(path, "no config.json", "params.json")


def test_missing_weights(good_dir, tmp_path):
    refused(broken_copy(good_dir, tmp_path, drop=("model.safetensors",)), "no weights", "model.safetensors")


def test_pytorch_bin_weights_are_refused(good_dir, tmp_path):
    path = broken_copy(good_dir, tmp_path, drop=("model.safetensors",))
    (Path(path) / "pytorch_model.bin").write_bytes(b"not read")
    refused(path, "pytorch_model*.bin", "safetensors")


def test_missing_shard(checkpoint, tmp_path):
    good = Path(checkpoint("qwen2_yarn_sharded"))
    index = json.loads((good / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[1]
    refused(broken_copy(good, tmp_path, drop=(lost,)), "model.safetensors.index.json", lost)


def test_missing_tokenizer(good_dir, tmp_path):
    refused(broken_copy(good_dir, tmp_path, drop=("tokenizer.json",)), "no tokenizer", "tokenizer.json")


def test_missing_lm_head_is_not_randomly_initialised(good_dir, tmp_path):
    """tie_word_embeddings false but no lm_head.weight in the file: transformers would start it from
    random values; the loader refuses instead."""
    from safetensors.torch import load_file, save_file

    path = Path(broken_copy(good_dir, tmp_path))
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EngineConfigError, match="lm_head.weight"):
        load_model_and_tokenizer(str(path))


def test_tokenizer_larger_than_vocab(test_tokenizer, tmp_path):
    """A model whose vocab is smaller than its tokenizer's would get token ids past its embedding: refused."""
    path = build_checkpoint(test_tokenizer, tmp_path / "v", "llama", dict(vocab_size=1024), {})
    with pytest.raises(EngineConfigError, match="vocab_size is 1024"):
        load_model_and_tokenizer(path)

