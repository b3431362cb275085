"""The linear layers' products: `Linear` keeps a weight (and on a CPU its oneDNN-prepacked copy)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here for `dtype` (bf16 needs a CPU oneDNN does bf16 on;
    elsewhere F.linear computes it)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """`y = x @ weight.T + bias`. On CPU the weight is reordered once into oneDNN's blocked layout.

    NOTE: F.linear repacks the weight on every call. Measured here (2 cores, fp32, SmolLM2's shapes,
    30 layers of weights that do not fit in cache): the prepacked path is 1.5x faster at 64 rows and
    2.2x at 8 (decode batches), ~1.15x at 1000 (prefill chunks). The cost is a second copy of the
    linear weights (the HF modules keep theirs: the model stays usable as a reference).

    `matmul_dtype` (bf16 on CPU): the weight is kept in it and `x` is rounded to it for the product,
    which comes back in `x`'s dtype (the CPU's bf16 path, see `ModelRunner`).
    """

    __slots__ = ("weight", "bias", "packed", "matmul_dtype", "out_dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool,
                 matmul_dtype: torch.dtype | None = None):
        self.out_dtype = weight.dtype  # what a call returns, whatever `x` comes in
        if matmul_dtype is not None and matmul_dtype != weight.dtype:
            weight = weight.detach().to(matmul_dtype)
            bias = None if bias is None else bias.detach().to(matmul_dtype)
        else:
            matmul_dtype = None
        self.weight, self.bias, self.matmul_dtype = weight, bias, matmul_dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if prepack else None
        if self.packed is not None and matmul_dtype is not None:
            self.weight = None  # the packed copy is all the product reads (the model keeps its own weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The product in the weight's own dtype (`x` in it, or already rounded to the matmul dtype)."""
        if self.matmul_dtype is not None:
            return self.product(x.to(self.matmul_dtype)).to(self.out_dtype)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The product for `x` already in the matmul dtype; the result is in it too."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
