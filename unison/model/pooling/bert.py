"""The BERT encoder family: sentence embeddings (`BertModel` with sentence-transformers' pooling
and normalize modules) and cross-encoder scores (`BertForSequenceClassification`).

A second forward beside the decoder's: bidirectional attention over each whole sequence, no KV
kept. The batch is flat (no padding between sequences); the linears run on fixed 64-row tiles and
attention runs sequence by sequence, so a sequence's vector has the same bits alone or in any
batch (a GEMM's row depends on its M: oneDNN picks other kernels for other shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from unison.model.kernels.cpu_kernels import CpuKernels, QuantPlan
from unison.model.pooling.encoder_config import EncoderConfig
from unison.model.weights.quant import quantize

# Rows per tile of a float linear: a row's bits depend on its GEMM's shape, so every row runs in
# a tile of exactly this many (zero-padded at the end). Larger tiles run faster, but pad a short
# query more: bf16 GEMMs reach their speed only from 128 rows, float32 nearly at 64.
TILE_ROWS = {"float32": 64, "bfloat16": 128}
KINDS = ("float32", "bfloat16", "int8")


class EncoderLinear:
    """x @ W.T + b for float32 rows, batch-invariant in each kind: float32 or bfloat16 GEMMs
    (oneDNN) on fixed tiles, or int8 weights on Unison's kernels, whose rows never depend on M."""

    def __init__(self, weight: Tensor, bias: Tensor, kind: str, kernels: CpuKernels | None) -> None:
        self.kind, self.bias = kind, bias.float()
        if kind == "int8":
            assert kernels is not None  # the runner checked they are built
            packed = quantize(weight, 8)
            self.kernels, self.plan = kernels, QuantPlan([packed])
            self.nbytes = packed.nbytes + self.bias.numel() * 4
        else:
            dtype = getattr(torch, kind)
            self.weight_t, self.tile_bias = weight.to(dtype).t(), bias.to(dtype)
            self.nbytes = weight.numel() * self.weight_t.element_size() + self.bias.numel() * 4

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "int8":
            return self.kernels.quant_linear(x.contiguous(), self.plan).add_(self.bias)
        n, rows = x.shape[0], TILE_ROWS[self.kind]
        tiles = -(-n // rows)
        padded = x.new_zeros(tiles * rows, x.shape[1], dtype=self.weight_t.dtype)
        padded[:n] = x
        out = padded.new_empty(tiles * rows, self.weight_t.shape[1])
        for t in range(tiles):
            part = slice(t * rows, (t + 1) * rows)
            torch.addmm(self.tile_bias, padded[part], self.weight_t, out=out[part])
        return out[:n].float()


@dataclass(slots=True)
class BertLayer:
    qkv: EncoderLinear  # query, key and value in one GEMM
    attn_out: EncoderLinear
    attn_norm: tuple[Tensor, Tensor]  # LayerNorm weight, bias
    up: EncoderLinear
    down: EncoderLinear
    out_norm: tuple[Tensor, Tensor]


class BertEncoder:
    """BERT's forward over a flat batch of whole sequences; returns one row per sequence: its
    pooled (and normalized) embedding, or its cross-encoder scores."""

    def __init__(self, config: EncoderConfig, tensors: dict[str, Tensor], kind: str = "float32",
                 kernels: CpuKernels | None = None) -> None:
        self.config, self.kind = config, kind
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
        def linear(name: str) -> EncoderLinear:
            return EncoderLinear(get(name + ".weight"), get(name + ".bias"), kind, kernels)

        self.layers: list[BertLayer] = []
        for i in range(config.num_layers):
            p = f"encoder.layer.{i}."
            attn = p + "attention.self."
            qkv_w = torch.cat([get(attn + f"{n}.weight") for n in ("query", "key", "value")])
            qkv_b = torch.cat([get(attn + f"{n}.bias") for n in ("query", "key", "value")])
            self.layers.append(BertLayer(
                qkv=EncoderLinear(qkv_w, qkv_b, kind, kernels),
                attn_out=linear(p + "attention.output.dense"),
                attn_norm=(get(p + "attention.output.LayerNorm.weight"),
                           get(p + "attention.output.LayerNorm.bias")),
                up=linear(p + "intermediate.dense"),
                down=linear(p + "output.dense"),
                out_norm=(get(p + "output.LayerNorm.weight"), get(p + "output.LayerNorm.bias")),
            ))
        if config.task == "rerank":  # the pooler and classifier stay float32: a few rows a step
            self.pooler = EncoderLinear(get("pooler.dense.weight"), get("pooler.dense.bias"), "float32", None)
            self.classifier = EncoderLinear(tensors["classifier.weight"].float(),
                                            tensors["classifier.bias"].float(), "float32", None)

    def linear_kinds(self) -> dict[str, str]:
        return {"encoder": self.kind}

    def weights_bytes(self) -> int:
        tensors = [self.word, self.position, self.token_type, *self.embed_norm]
        tensors += [t for layer in self.layers for t in (*layer.attn_norm, *layer.out_norm)]
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.attn_out, layer.up, layer.down)]
        if self.config.task == "rerank":
            linears += [self.pooler, self.classifier]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(lin.nbytes for lin in linears)

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

    def _layer(self, h: Tensor, lengths: list[int], layer: BertLayer) -> Tensor:
        cfg = self.config
        heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        qkv = layer.qkv(h)
        ctx = torch.empty_like(h)
        start = 0
        for n in lengths:  # each sequence attends to itself only, in both directions
            q, k, v = qkv[start: start + n].view(n, 3, heads, head_dim).permute(1, 2, 0, 3)
            # bmm, softmax, bmm: twice as fast as torch's fused CPU attention at these small
            # heads, and like it, a sequence's bits never depend on the others'.
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(head_dim ** -0.5)
            out = torch.bmm(torch.softmax(scores, dim=-1), v)
            ctx[start: start + n] = out.transpose(0, 1).reshape(n, cfg.hidden_size)
            start += n
        h = self._norm(layer.attn_out(ctx) + h, layer.attn_norm)
        return self._norm(layer.down(F.gelu(layer.up(h))) + h, layer.out_norm)

    def _norm(self, x: Tensor, weight_bias: tuple[Tensor, Tensor]) -> Tensor:
        weight, bias = weight_bias
        return F.layer_norm(x, (self.config.hidden_size,), weight, bias, self.config.layer_norm_eps)

    def _scores(self, cls_rows: Tensor) -> Tensor:
        logits = self.classifier(torch.tanh(self.pooler(cls_rows)))
        return torch.sigmoid(logits) if self.config.sigmoid else logits


def _pool(rows: Tensor, mode: str) -> Tensor:
    if mode == "cls":
        return rows[0]
    if mode == "lasttoken":
        return rows[-1]
    if mode == "max":
        return rows.max(dim=0).values
    return rows.mean(dim=0)
