"""How the int8 KV cache rounds keys: a weight W per layer and kv head, measured once at load.

What a key's rounding error e costs is the score error q . e of each query that reads it, and
queries are far from isotropic (one mean direction carries about half of a head's query energy
on SmolLM2). So csrc/fused_ops.c (shape_key_q8) rounds each key to keep e^T W e small, with
W = E[q q^T] over the queries of the key's head, in the rotated coordinates the cache stores
keys in. W comes from one forward over a fixed text (key_rounding.txt) when the engine loads, so
it depends on the weights alone: every run of a model rounds alike, and a key's rounding reads its
own row and W only (batch invariance holds). A weight update keeps W: it only chooses which way
a value rounds, never how far."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

TEXT = Path(__file__).with_name("key_rounding.txt")
MAX_TOKENS = 768  # the whole text (639 tokens on SmolLM2); 384 measured a noisier W (BENCHMARKS.md)


def text_ids(model_dir: Path) -> list[int] | None:
    """The fixed text's token ids, or None when the model has no tokenizer.json (keys then
    round to nearest)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    return Tokenizer.from_file(str(path)).encode(TEXT.read_text(), add_special_tokens=False).ids[:MAX_TOKENS]


def hadamard(d: int) -> Tensor:
    """hadamard_rotate's matrix (csrc/fused_ops.c): orthonormal Sylvester blocks of the largest
    power of two dividing d, on the diagonal."""
    r = d & -d
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < r:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / math.sqrt(r)] * (d // r))


class QueryMoments:
    """Sums q q^T per layer and kv head over the queries a forward attends with (an attention
    function's wrapper), then gives W: [layers, kv_heads, head_dim, head_dim] float32."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        self.kv_heads, self.rotation = kv_heads, hadamard(head_dim)
        # float64: W must not depend on how the sum was split over threads
        self.sums = torch.zeros(layers, kv_heads, head_dim, head_dim, dtype=torch.float64)
        self.count = 0

    def wrap(self, attend: Callable[[int, Tensor, Tensor, Tensor], Tensor]
             ) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
        def measured(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            n, heads, d = q.shape
            rotated = q.double().reshape(n, self.kv_heads, heads // self.kv_heads, d) @ self.rotation
            self.sums[layer] += torch.einsum("nhgi,nhgj->hij", rotated, rotated)
            self.count = n * heads // self.kv_heads  # queries per kv head: each layer's alike
            return attend(layer, q, k, v)
        return measured

    def weight(self) -> Tensor:
        return (self.sums / max(self.count, 1)).float().contiguous()
