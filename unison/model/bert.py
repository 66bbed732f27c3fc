"""The BERT encoder family: sentence embeddings (`BertModel` with sentence-transformers' pooling
and normalize modules) and cross-encoder scores (`BertForSequenceClassification`).

A second forward beside the decoder's: bidirectional attention over each whole sequence, no KV
kept. The batch is flat (no padding between sequences); the linears run on fixed 64-row tiles and
attention runs sequence by sequence, so a sequence's vector has the same bits alone or in any
batch (a GEMM's row depends on its M: oneDNN picks other kernels for other shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .encoder_config import EncoderConfig

TILE_ROWS = 64  # every linear runs on tiles of exactly this many rows (see the module's doc)


def _tiled_linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x @ weight.T + bias, on tiles of exactly TILE_ROWS rows (zero-padded at the end)."""
    n = x.shape[0]
    tiles = -(-n // TILE_ROWS)
    padded = x.new_zeros(tiles * TILE_ROWS, x.shape[1])
    padded[:n] = x
    out = x.new_empty(tiles * TILE_ROWS, weight.shape[0])
    wt = weight.t()
    for t in range(tiles):
        rows = slice(t * TILE_ROWS, (t + 1) * TILE_ROWS)
        torch.addmm(bias, padded[rows], wt, out=out[rows])
    return out[:n]


class BertEncoder:
    """BERT's forward over a flat batch of whole sequences; returns one row per sequence: its
    pooled (and normalized) embedding, or its cross-encoder scores."""

    def __init__(self, config: EncoderConfig, tensors: dict[str, Tensor]) -> None:
        self.config = config
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in tensors else ""

        def get(name: str) -> Tensor:
            try:
                return tensors[prefix + name].float().contiguous()
            except KeyError:
                raise ValueError(f"the checkpoint has no tensor {prefix + name!r}") from None

        self.word = get("embeddings.word_embeddings.weight")
        self.position = get("embeddings.position_embeddings.weight")
        self.token_type = get("embeddings.token_type_embeddings.weight")
        self.embed_norm = (get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(config.num_layers):
            p = f"encoder.layer.{i}."
            attn = p + "attention.self."
            qkv_w = torch.cat([get(attn + f"{n}.weight") for n in ("query", "key", "value")])
            qkv_b = torch.cat([get(attn + f"{n}.bias") for n in ("query", "key", "value")])
            self.layers.append((
                (qkv_w, qkv_b),
                (get(p + "attention.output.dense.weight"), get(p + "attention.output.dense.bias")),
                (get(p + "attention.output.LayerNorm.weight"), get(p + "attention.output.LayerNorm.bias")),
                (get(p + "intermediate.dense.weight"), get(p + "intermediate.dense.bias")),
                (get(p + "output.dense.weight"), get(p + "output.dense.bias")),
                (get(p + "output.LayerNorm.weight"), get(p + "output.LayerNorm.bias")),
            ))
        if config.task == "rerank":
            self.pooler = (get("pooler.dense.weight"), get("pooler.dense.bias"))
            self.classifier = (tensors["classifier.weight"].float(), tensors["classifier.bias"].float())

    def linear_kinds(self) -> dict[str, str]:
        return {"encoder": "float32"}

    def weights_bytes(self) -> int:
        tensors = [self.word, self.position, self.token_type, *self.embed_norm]
        tensors += [t for layer in self.layers for pair in layer for t in pair]
        if self.config.task == "rerank":
            tensors += [*self.pooler, *self.classifier]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, sequences: list[list[int]]) -> Tensor:
        cfg = self.config
        lengths = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        types = torch.cat([self._token_types(s) for s in sequences])
        h = self.word[ids] + self.token_type[types] + self.position[positions]
        h = self._norm(h, self.embed_norm)
        for layer in self.layers:
            h = self._layer(h, lengths, layer)
        rows = list(torch.split(h, lengths))
        if cfg.task == "rerank":
            return self._scores(torch.stack([r[0] for r in rows]))
        pooled = torch.stack([_pool(r, cfg.pooling) for r in rows])
        return F.normalize(pooled, p=2, dim=-1) if cfg.normalize else pooled

    def _token_types(self, seq: list[int]) -> Tensor:
        """0 through the first [SEP], 1 after it: a (query, document) pair's two segments."""
        types = torch.zeros(len(seq), dtype=torch.long)
        sep = self.config.sep_token_id
        if self.config.type_vocab_size > 1 and sep is not None and sep in seq:
            types[seq.index(sep) + 1:] = 1
        return types

    def _layer(self, h: Tensor, lengths: list[int], layer) -> Tensor:
        cfg = self.config
        (qkv_w, qkv_b), (o_w, o_b), attn_norm, (up_w, up_b), (down_w, down_b), out_norm = layer
        heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        qkv = _tiled_linear(h, qkv_w, qkv_b)
        ctx = torch.empty_like(h)
        start = 0
        for n in lengths:  # each sequence attends to itself only, in both directions
            q, k, v = qkv[start: start + n].view(n, 3, heads, head_dim).permute(1, 2, 0, 3)
            out = F.scaled_dot_product_attention(q, k, v)
            ctx[start: start + n] = out.transpose(0, 1).reshape(n, cfg.hidden_size)
            start += n
        h = self._norm(_tiled_linear(ctx, o_w, o_b) + h, attn_norm)
        up = F.gelu(_tiled_linear(h, up_w, up_b))
        return self._norm(_tiled_linear(up, down_w, down_b) + h, out_norm)

    def _norm(self, x: Tensor, weight_bias: tuple[Tensor, Tensor]) -> Tensor:
        weight, bias = weight_bias
        return F.layer_norm(x, (self.config.hidden_size,), weight, bias, self.config.layer_norm_eps)

    def _scores(self, cls_rows: Tensor) -> Tensor:
        pooled = torch.tanh(_tiled_linear(cls_rows, *self.pooler))
        logits = _tiled_linear(pooled, *self.classifier)
        return torch.sigmoid(logits) if self.config.sigmoid else logits


def _pool(rows: Tensor, mode: str) -> Tensor:
    if mode == "cls":
        return rows[0]
    if mode == "lasttoken":
        return rows[-1]
    if mode == "max":
        return rows.max(dim=0).values
    return rows.mean(dim=0)
