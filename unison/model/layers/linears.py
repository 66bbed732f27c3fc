"""The model's dense linears, float or quantized, and its token embedding: what a layer's
projections run on. Float linears are prepacked once for oneDNN; quantized ones run the C kernel
on int4 / int8 blocks (quant.py, csrc/quant_linear.c)."""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from unison.model.kernels import cpu_kernels
from unison.model.weights.quant import QuantWeight

log = logging.getLogger(__name__)


class Linear:
    """y = x @ weight.T + bias. On CPU the weight is prepacked once for oneDNN, whose GEMMs run
    1.2-3x faster here than F.linear's at every batch size (decode, 64-way decode, prefill)."""

    __slots__ = ("weight", "bias", "packed", "dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight: torch.Tensor | None = weight
        self.bias, self.dtype = bias, weight.dtype
        self.packed = _onednn_pack(weight)
        if self.packed is not None:
            self.weight = None  # the packed copy is all that is needed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.dtype:
            return self._matmul(x, self.bias)
        # bf16 weights in a float32 model (CPU): converted at the edges, the bias added in float32
        y = self._matmul(x.to(self.dtype), None).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None  # dropped only once packed
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    @property
    def held(self) -> torch.Tensor:
        """The tensor kept: the weight, or its packed copy."""
        held = self.weight if self.weight is not None else self.packed
        assert held is not None  # one of the two is always kept
        return held


_ONEDNN: bool | None = None  # whether packed oneDNN linears work here; probed on first use


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    global _ONEDNN
    if weight.device.type != "cpu" or os.environ.get("UNISON_ONEDNN_LINEAR") == "0":
        return None
    if _ONEDNN is None:
        _ONEDNN = _probe_onednn()
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64) if _ONEDNN else None


def _probe_onednn() -> bool:
    # Private ops (torch.compile's CPU freezing uses them): check they exist and match F.linear.
    try:
        w, x = torch.randn(24, 16), torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        ok = torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError) as e:
        log.info("oneDNN packed linear unavailable (%s): using F.linear", e)
        return False
    if not ok:
        log.warning("oneDNN packed linear disagrees with F.linear: using F.linear")
    return ok


class QuantLinear:
    """y = x @ W.T (+ bias) with W in int4 / int8 blocks (quant.py), run by the C kernel.

    A fused linear (q|k|v, gate|up) may hold parts of different kinds: a GGUF can store v wider
    than q and k. The activations are quantized once for all parts."""

    __slots__ = ("parts", "bias", "kernels", "plan")

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, kernels: cpu_kernels.CpuKernels):
        self.parts, self.bias, self.kernels = parts, bias, kernels
        self.plan = cpu_kernels.QuantPlan(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.quant_linear(x, self.plan)
        return y if self.bias is None else y.add_(self.bias)

    @property
    def kind(self) -> str:
        """int4 / int8 / a mix, with the kernels' instruction-set path: e.g. int4/vnni."""
        return self.kernels.kinds(self.parts)


class Embedding:
    """Token embeddings: a float table, or the quantized weight a tied LM head also runs on."""

    __slots__ = ("table", "quant", "kernels")

    def __init__(self, table: torch.Tensor | None, quantized: QuantWeight | None = None,
                 kernels: cpu_kernels.CpuKernels | None = None):
        self.table, self.quant, self.kernels = table, quantized, kernels

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.float_table)
        assert self.kernels is not None  # quantized weights run on the C kernels only
        return self.kernels.dequantize_rows(self.quant, ids)

    @property
    def float_table(self) -> torch.Tensor:
        """The float table (of an embedding that is not quantized)."""
        assert self.table is not None
        return self.table

    @property
    def kind(self) -> str:
        return str(self.float_table.dtype).removeprefix("torch.") if self.quant is None else self.quant.kind

    @property
    def nbytes(self) -> int:
        if self.quant is not None:
            return self.quant.nbytes
        return self.float_table.numel() * self.float_table.element_size()
