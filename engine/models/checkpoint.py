"""Where a tensor-parallel rank reads its slices from (`shard_weights`), by the checkpoint's parameter names.

`SafetensorsTensors`: the model directory's `*.safetensors` files (one, or several with an index),
memory-mapped: a slice reads only its own bytes. `ModuleTensors`: an HF model already loaded whole
(a GGUF-converted or other checkpoint that is not in that form, or a prebuilt model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _span(rows: tuple[int, int] | None) -> slice:
    return slice(None) if rows is None else slice(*rows)


class ModuleTensors:
    """The parameters of a loaded HF model (copies of the slices asked for)."""

    def __init__(self, hf_model):
        self._params = dict(hf_model.named_parameters(remove_duplicate=False))

    def has(self, name: str) -> bool:
        return name in self._params

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        t = self._params[name].detach()
        t = t[_span(rows)] if cols is None else t[_span(rows), _span(cols)]
        return t.clone()


class SafetensorsTensors:
    """A checkpoint directory's safetensors tensors, read slice by slice, in `dtype` on `device`."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device):
        from safetensors import safe_open

        self.dtype, self.device = dtype, device
        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.exists():
            files = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: str(root / f) for name, f in files.items()}
        else:
            single = root / "model.safetensors"
            with safe_open(str(single), "pt", device="cpu") as f:
                self._file_of = {name: str(single) for name in f.keys()}
        self._open = safe_open
        self._handles: dict[str, object] = {}

    @classmethod
    def available(cls, model_dir: str) -> bool:
        root = Path(model_dir)
        return (root / "model.safetensors.index.json").exists() or (root / "model.safetensors").exists()

    def has(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = self._open(path, "pt", device="cpu")
        sl = self._handles[path].get_slice(name)
        t = sl[_span(rows)] if cols is None else sl[_span(rows), _span(cols)]
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def close(self) -> None:
        self._handles.clear()
