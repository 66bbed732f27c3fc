"""How the int8 KV cache stores keys: per layer and kv head, a mean and a weight W, measured once
at load over a fixed text (key_rounding.txt).

- The mean: about half a key's energy lies along a direction all keys of its head share, and it
  sets the q8 blocks' scales. So csrc/fused_ops.c (store_kv) stores each block of 32 whole or less
  the mean, whichever needs the smaller scale, marked in the block (csrc/q8.h), and the reader adds
  the mean back: a finer step for the same bytes. Not every block: the first token's key, which
  takes much of the attention, lies far from the mean.
- W: what a key's rounding error e costs is the score error q . e of each query that reads it, and
  queries are far from isotropic (one mean direction carries about half of a head's query energy
  on SmolLM2). So shape_key_q8 rounds each key to keep e^T W e small, with W = E[q q^T] over the
  queries of the key's head.

Both are in the rotated coordinates the cache stores keys in, and depend on the weights alone:
every run of a model stores alike, and a key's storing reads its own row, the mean and W only
(batch invariance holds). A weight update keeps them: the keys cached so far were stored less
this mean, and W only chooses which way a value rounds, never how far."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

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


class KeyRounding(NamedTuple):
    """What store_kv takes for int8 keys, rotated: `mean` [layers, kv_heads, head_dim] is
    subtracted, then `weight` [layers, kv_heads, head_dim, head_dim] (W) rounds. float32."""

    weight: Tensor
    mean: Tensor


class Moments:
    """Sums q q^T and k per layer and kv head over the queries and keys a forward attends with (an
    attention function's wrapper), then gives the KeyRounding."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        self.kv_heads, self.rotation = kv_heads, hadamard(head_dim)
        # float64: the result must not depend on how the sums were split over threads
        self.query_sums = torch.zeros(layers, kv_heads, head_dim, head_dim, dtype=torch.float64)
        self.key_sums = torch.zeros(layers, kv_heads, head_dim, dtype=torch.float64)
        self.queries = self.keys = 0

    def wrap(self, attend: Callable[[int, Tensor, Tensor, Tensor], Tensor]
             ) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
        def measured(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            n, heads, d = q.shape
            rotated = q.double().reshape(n, self.kv_heads, heads // self.kv_heads, d) @ self.rotation
            self.query_sums[layer] += torch.einsum("nhgi,nhgj->hij", rotated, rotated)
            self.key_sums[layer] += (k.double().reshape(n, self.kv_heads, d) @ self.rotation).sum(0)
            self.queries, self.keys = n * heads // self.kv_heads, n  # per kv head; each layer's alike
            return attend(layer, q, k, v)
        return measured

    def rounding(self) -> KeyRounding:
        return KeyRounding((self.query_sums / max(self.queries, 1)).float().contiguous(),
                           (self.key_sums / max(self.keys, 1)).float().contiguous())
