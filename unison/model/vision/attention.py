"""Attention over an image's patches, as the vision towers run it: every patch sees every patch."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from unison.model.kernels import cpu_kernels


def image_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bf16: bool) -> Tensor:
    """q, k, v [patches, heads, d] float32 -> [patches, heads * d] float32.

    A tower whose linears run in bfloat16 (so q, k and v are bfloat16 values) takes bfloat16 dot
    products with float32 sums where the CPU has them (csrc/image_attention.c, twice torch's
    float32 rate); a float32 tower, or another CPU, torch's float32 attention, which is exact and
    here faster than its bfloat16 one."""
    n = q.shape[0]
    if bf16 and q.device.type == "cpu":
        kernels = cpu_kernels.load()
        out = kernels.image_attention(q, k, v, scale) if kernels is not None else None
        if out is not None:
            return out.view(n, -1)
    ctx = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], scale=scale)
    return ctx[0].transpose(0, 1).reshape(n, -1)
