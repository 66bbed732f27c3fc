"""The per-layer small operations in torch: any device and dtype, and the reference the C
versions (cpu_kernels.CpuKernels, the same methods) are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """The per-layer small operations in torch: any device and dtype; the reference for the C
    versions (cpu_kernels.CpuKernels has the same methods)."""

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, eps)

    @staticmethod
    def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        x = x[:, : heads * head_dim].view(x.shape[0], heads, head_dim)[..., : 2 * cos.shape[1]]
        x.copy_(apply_rope(x, cos[:, None], sin[:, None]))

    @staticmethod
    def row_gates(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid((x * w).sum(-1))

    @staticmethod
    def mul_act_(x: torch.Tensor, gate: torch.Tensor, activation: str) -> None:
        x.mul_(torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))

    @staticmethod
    def delta_gates(a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                    neg_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.softplus(a.float() + dt_bias) * neg_a, torch.sigmoid(b.float())

    @staticmethod
    def norm_groups_(x: torch.Tensor, groups: int, dim: int, weight: torch.Tensor, eps: float) -> None:
        n = x.shape[0]
        x.copy_(rms_norm(x.reshape(n, groups, dim), weight, eps).view(n, groups * dim))

    @staticmethod
    def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if activation == "swiglu_oai":
            return swiglu_oai(gate, up)
        if activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh").mul_(up)
        return F.silu(gate, inplace=True).mul_(up)


SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's, as transformers has them


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, in transformers' order of operations."""
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The same operation order as transformers, so fp32 results match it bit for bit.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
