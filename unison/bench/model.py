"""`unison bench make-model`: a GGUF of a real size, for speed figures only.

Speed at 135M parameters is not speed at 1B: per-step overheads and the LM head dominate a small
model, the linears a large one. No 1B or 3B GGUF ships on PyPI, so this writes one: the shapes
of Llama 3.2 1B / 3B, of Qwen3-30B-A3B (a mixture of 128 experts, 8 per token), of
Qwen3.5-35B-A3B (three Gated DeltaNet layers to one of gated attention, 256 experts, 8 per token,
and a shared expert), or of gpt-oss-20b (32 experts, 4 per token, in MXFP4 as its files have
them; attention in Q8_0, with biases and sinks, an untied Q8_0 LM head), random Q4_0 linears
and experts elsewhere, a Q8_0 embedding (tied to the LM head),
float32 norms, router and DeltaNet parameters, and the embedded model's tokenizer, so both
Unison and llama.cpp read it and any client can send it text. `--qtype` other than q4_0 writes
the weights in F16 and, for a quantized type, has llama.cpp's own `llama-quantize` turn them into
it (Q4_K_M: the file users download, with llama.cpp's choice of Q6_K tensors). (The vocabulary is the embedded
tokenizer's 49,152, not Qwen3.5's 248,320: its LM head reads 0.1 GB a token less.) The weights
are random bytes: what it generates is meaningless text, at the speed real weights of that size
would run. Tensors are written one at a time, never all in memory.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # gguf loads when a model is written
    from gguf import GGUFWriter

    from unison.model.weights.gguf_header import Field

# Llama 3.2's shapes and Qwen3-30B-A3B's (vocabulary: the embedded tokenizer's).
SHAPES = {
    "1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192},
    "3b": {"hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "ffn": 8192},
    "30b-a3b": {"hidden": 2048, "layers": 48, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128,
                "top_k": 8, "ffn": 768},
    # Qwen3.5-35B-A3B: every 4th layer full attention (16 query heads of 256, half rotated, gated),
    # the rest Gated DeltaNet (16 key heads, 32 value heads, of 128; convolution of 4)
    "qwen3.5-35b-a3b": {"hidden": 2048, "layers": 40, "heads": 16, "kv_heads": 2, "head_dim": 256,
                        "experts": 256, "top_k": 8, "ffn": 512, "shared_ffn": 512, "k_heads": 16,
                        "v_heads": 32, "state": 128, "conv": 4},
}
HYBRID_ARCH = "qwen35moe"
# gpt-oss-20b: 24 layers alternating a 128-token window and full attention, 64 query heads and 8
# KV heads of 64, 32 experts of 2880 (4 per token) in MXFP4
SHAPES["gpt-oss-20b"] = {"hidden": 2880, "layers": 24, "heads": 64, "kv_heads": 8, "head_dim": 64,
                         "experts": 32, "top_k": 4, "ffn": 2880, "gpt_oss": 1}


def _blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """Raw GGUF rows of Q4_0 (fp16 d + 16 bytes of nibbles per 32), Q8_0 (fp16 d + 32 int8) or
    MXFP4 (an e8m0 byte + 16 of nibbles), d around 1 / sqrt(cols) so activations stay finite
    through the layers."""
    if kind == "MXFP4":  # 2^(e - 127) * 6 (the largest e2m1) about 1 / sqrt(cols)
        e = np.round(127 - np.log2(6 * np.sqrt(cols))) + rng.integers(-1, 1, (rows, cols // 32, 1))
        q = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
        return np.concatenate([e.astype(np.uint8), q], axis=2).reshape(rows, -1)
    per_block = 16 if kind == "Q4_0" else 32
    nb = cols // 32
    d = (rng.uniform(0.5, 1.5, (rows, nb, 1)) / (8 * np.sqrt(cols))).astype(np.float16)
    q = rng.integers(0, 256, (rows, nb, per_block), dtype=np.uint8)
    return np.concatenate([d.view(np.uint8), q], axis=2).reshape(rows, -1)


def copy_fields(writer: GGUFWriter, fields: dict[str, Field], renames: dict[str, str] | None = None,
                extend: dict[str, list] | None = None) -> None:
    """`fields` (gguf_header.read_fields') into `writer`: `renames` gives some tokens of
    tokenizer.ggml.tokens other strings (a vocabulary with FIM tokens, for the infill routes'
    tests), `extend` appends to arrays (a vocabulary grown by image tokens)."""
    from gguf import GGUFValueType

    for name, field in fields.items():
        value = field.value
        if name == "tokenizer.ggml.tokens" and renames:
            value = [renames.get(t, t) for t in value]
        if extend and name in extend:
            value = value + extend[name]
        sub = None if field.elem_type is None else GGUFValueType(field.elem_type)
        writer.add_key_value(name, value, GGUFValueType(field.kind), sub_type=sub)


def write_grown_tensors(writer: GGUFWriter, text_model: Path, extra: int, out: Path) -> Path:
    """`text_model`'s tensors into `writer` (its fields written already), the vocabulary's rows
    (the embedding's, and the output's where it has one) grown by `extra` zero rows; the file
    written to `out`."""
    from gguf import GGUFReader

    for tensor in GGUFReader(text_model).tensors:
        data = np.asarray(tensor.data)
        if tensor.name in ("token_embd.weight", "output.weight"):  # zero bytes: a zero row in any format
            data = np.concatenate([data, np.zeros((extra, *data.shape[1:]), data.dtype)])
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@functools.cache
def embedded_tokenizer() -> dict[str, Field]:
    """The embedded model's tokenizer fields, which every written model carries: read once."""
    from unison.model.weights.gguf_header import read_fields
    from unison.model.weights.loader import default_gguf_path

    return read_fields(default_gguf_path(), "tokenizer.")


def write_model(shape: dict[str, int], out: Path, seed: int = 0,
                renames: dict[str, str] | None = None, float16: bool = False) -> Path:
    """Writes a model of `shape` (as SHAPES holds them) to `out`; returns `out`. `renames`: tokens
    of the embedded vocabulary given other strings. `float16`: the linears and the embedding in
    F16 (for llama-quantize), else random Q4_0 / Q8_0 blocks."""
    from gguf import GGUFWriter

    s, rng, tokenizer = shape, np.random.default_rng(seed), embedded_tokenizer()
    vocab = len(tokenizer["tokenizer.ggml.tokens"].value)
    moe, hybrid = "experts" in s, "v_heads" in s
    head_dim = s.get("head_dim", s["hidden"] // s["heads"])
    arch = HYBRID_ARCH if hybrid else "gpt-oss" if "gpt_oss" in s else "qwen3moe" if moe else "llama"
    w = GGUFWriter(out, arch)
    w.add_name(f"unison-bench-{arch}-{s['layers']}x{s['hidden']}-random")
    w.add_block_count(s["layers"])
    w.add_context_length(8192)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(150000.0 if arch == "gpt-oss" else 500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim // 4 if hybrid else head_dim)
    w.add_vocab_size(vocab)
    if moe:
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["top_k"])
        w.add_expert_feed_forward_length(s["ffn"])
    if hybrid:
        w.add_expert_shared_feed_forward_length(s["shared_ffn"])
        w.add_ssm_conv_kernel(s["conv"])
        w.add_ssm_state_size(s["state"])
        w.add_ssm_group_count(s["k_heads"])
        w.add_ssm_time_step_rank(s["v_heads"])
        w.add_ssm_inner_size(s["v_heads"] * s["state"])
        w.add_full_attention_interval(4)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if arch == "gpt-oss":  # its own rope and window, as llama.cpp's converter writes them
        w.add_sliding_window(128)
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_file_type(1 if float16 else 2)  # all F16, or mostly Q4_0
    copy_fields(w, tokenizer, renames)
    tensors = _tensors(s, vocab, head_dim)
    if float16:
        tensors = {n: (r, c, "F16" if k in ("Q4_0", "Q8_0") else k) for n, (r, c, k) in tensors.items()}
    for name, (rows, cols, kind) in tensors.items():
        _add_info(w, name, rows, cols, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for rows, cols, kind in tensors.values():
        w.write_tensor_data(_data(rng, rows, cols, kind))
    w.close()
    return out


# name -> (rows, cols, kind): rows is a tuple (experts, rows) for stacked experts; kind F32 for
# norms (all ones) and routers (random), Q4_0 / Q8_0 random blocks otherwise.
_Spec = tuple[int | tuple[int, int], int, str]


def _tensors(s: dict[str, int], vocab: int, head_dim: int) -> dict[str, _Spec]:
    if "v_heads" in s:
        return _hybrid_tensors(s, vocab, head_dim)
    if "gpt_oss" in s:
        return _gpt_oss_tensors(s, vocab, head_dim)
    hidden, q, kv = s["hidden"], s["heads"] * head_dim, s["kv_heads"] * head_dim
    specs: dict[str, _Spec] = {"token_embd.weight": (vocab, hidden, "Q8_0"),
                               "output_norm.weight": (1, hidden, "F32")}
    for i in range(s["layers"]):
        b = f"blk.{i}."
        specs |= {b + "attn_norm.weight": (1, hidden, "F32"), b + "ffn_norm.weight": (1, hidden, "F32"),
                  b + "attn_q.weight": (q, hidden, "Q4_0"), b + "attn_k.weight": (kv, hidden, "Q4_0"),
                  b + "attn_v.weight": (kv, hidden, "Q4_0"), b + "attn_output.weight": (hidden, q, "Q4_0")}
        if "experts" not in s:
            specs |= {b + "ffn_gate.weight": (s["ffn"], hidden, "Q4_0"),
                      b + "ffn_up.weight": (s["ffn"], hidden, "Q4_0"),
                      b + "ffn_down.weight": (hidden, s["ffn"], "Q4_0")}
            continue
        e = s["experts"]
        specs |= {b + "attn_q_norm.weight": (1, head_dim, "F32"),
                  b + "attn_k_norm.weight": (1, head_dim, "F32"),
                  b + "ffn_gate_inp.weight": (e, hidden, "router"),
                  b + "ffn_gate_exps.weight": ((e, s["ffn"]), hidden, "Q4_0"),
                  b + "ffn_up_exps.weight": ((e, s["ffn"]), hidden, "Q4_0"),
                  b + "ffn_down_exps.weight": ((e, hidden), s["ffn"], "Q4_0")}
    return specs


def _hybrid_tensors(s: dict[str, int], vocab: int, head_dim: int) -> dict[str, _Spec]:
    """Qwen3.5-MoE's tensors, named and shaped as llama.cpp's converter writes them (qwen35moe)."""
    hidden, e, ffn, shared = s["hidden"], s["experts"], s["ffn"], s["shared_ffn"]
    key_dim, value_dim, vh = s["k_heads"] * s["state"], s["v_heads"] * s["state"], s["v_heads"]
    specs: dict[str, _Spec] = {"token_embd.weight": (vocab, hidden, "Q8_0"),
                               "output_norm.weight": (1, hidden, "F32")}
    for i in range(s["layers"]):
        b = f"blk.{i}."
        specs |= {b + "attn_norm.weight": (1, hidden, "F32"),
                  b + "post_attention_norm.weight": (1, hidden, "F32")}
        if (i + 1) % 4:  # Gated DeltaNet
            specs |= {b + "attn_qkv.weight": (2 * key_dim + value_dim, hidden, "Q4_0"),
                      b + "attn_gate.weight": (value_dim, hidden, "Q4_0"),
                      b + "ssm_beta.weight": (vh, hidden, "Q4_0"),
                      b + "ssm_alpha.weight": (vh, hidden, "Q4_0"),
                      b + "ssm_conv1d.weight": (2 * key_dim + value_dim, s["conv"], "conv"),
                      b + "ssm_dt.bias": (1, vh, "F32"), b + "ssm_a": (1, vh, "decay"),
                      b + "ssm_norm.weight": (1, s["state"], "F32"),
                      b + "ssm_out.weight": (hidden, value_dim, "Q4_0")}
        else:  # gated attention: q_proj gives each head's query and gate
            q, kv = s["heads"] * head_dim, s["kv_heads"] * head_dim
            specs |= {b + "attn_q.weight": (2 * q, hidden, "Q4_0"), b + "attn_k.weight": (kv, hidden, "Q4_0"),
                      b + "attn_v.weight": (kv, hidden, "Q4_0"),
                      b + "attn_output.weight": (hidden, q, "Q4_0"),
                      b + "attn_q_norm.weight": (1, head_dim, "F32"),
                      b + "attn_k_norm.weight": (1, head_dim, "F32")}
        specs |= {b + "ffn_gate_inp.weight": (e, hidden, "router"),
                  b + "ffn_gate_exps.weight": ((e, ffn), hidden, "Q4_0"),
                  b + "ffn_up_exps.weight": ((e, ffn), hidden, "Q4_0"),
                  b + "ffn_down_exps.weight": ((e, hidden), ffn, "Q4_0"),
                  b + "ffn_gate_shexp.weight": (shared, hidden, "Q4_0"),
                  b + "ffn_up_shexp.weight": (shared, hidden, "Q4_0"),
                  b + "ffn_down_shexp.weight": (hidden, shared, "Q4_0"),
                  b + "ffn_gate_inp_shexp.weight": (1, hidden, "router")}
    return specs


def _gpt_oss_tensors(s: dict[str, int], vocab: int, head_dim: int) -> dict[str, _Spec]:
    """gpt-oss's tensors, named and shaped as llama.cpp's converter writes them (gpt-oss)."""
    hidden, e, ffn = s["hidden"], s["experts"], s["ffn"]
    q, kv = s["heads"] * head_dim, s["kv_heads"] * head_dim
    specs: dict[str, _Spec] = {"token_embd.weight": (vocab, hidden, "Q8_0"),
                               "output_norm.weight": (1, hidden, "F32"),
                               "output.weight": (vocab, hidden, "Q8_0")}
    for i in range(s["layers"]):
        b = f"blk.{i}."
        specs |= {b + "attn_norm.weight": (1, hidden, "F32"),
                  b + "post_attention_norm.weight": (1, hidden, "F32"),
                  b + "attn_q.weight": (q, hidden, "Q8_0"), b + "attn_k.weight": (kv, hidden, "Q8_0"),
                  b + "attn_v.weight": (kv, hidden, "Q8_0"), b + "attn_output.weight": (hidden, q, "Q8_0"),
                  b + "attn_q.bias": (1, q, "bias"), b + "attn_k.bias": (1, kv, "bias"),
                  b + "attn_v.bias": (1, kv, "bias"), b + "attn_output.bias": (1, hidden, "bias"),
                  b + "attn_sinks.weight": (1, s["heads"], "bias"),
                  b + "ffn_gate_inp.weight": (e, hidden, "router"), b + "ffn_gate_inp.bias": (1, e, "bias"),
                  b + "ffn_gate_exps.weight": ((e, ffn), hidden, "MXFP4"),
                  b + "ffn_up_exps.weight": ((e, ffn), hidden, "MXFP4"),
                  b + "ffn_down_exps.weight": ((e, hidden), ffn, "MXFP4"),
                  b + "ffn_gate_exps.bias": (e, ffn, "bias"), b + "ffn_up_exps.bias": (e, ffn, "bias"),
                  b + "ffn_down_exps.bias": (e, hidden, "bias")}
    return specs


def _add_info(w: GGUFWriter, name: str, rows: int | tuple[int, int], cols: int, kind: str) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    shape: tuple[int, ...]
    if isinstance(rows, tuple):
        shape = (*rows, cols)
    else:  # norms: one row, written as a vector
        shape = (rows, cols) if rows > 1 or kind not in ("F32", "decay", "bias") else (cols,)
    if kind == "router" and rows == 1:  # the shared expert's gate: [1, hidden]
        shape = (1, cols)
    count = int(np.prod(shape))
    if kind in ("F32", "router", "conv", "decay", "F16", "bias"):
        dtype = np.dtype(np.float16 if kind == "F16" else np.float32)
        w.add_tensor_info(name, shape, dtype, count * dtype.itemsize)
        return
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], cols // block * size)
    w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), count // block * size, raw_dtype=qtype)


def _data(rng: np.random.Generator, rows: int | tuple[int, int], cols: int, kind: str) -> np.ndarray:
    if kind == "F16":  # the spread of the random Q4_0 blocks' values
        shape = (*rows, cols) if isinstance(rows, tuple) else (rows, cols)
        return (rng.standard_normal(shape, np.float32) * (0.5 / np.sqrt(cols))).astype(np.float16)
    if isinstance(rows, tuple):  # experts: quantized, one matrix each
        return _blocks(rng, rows[0] * rows[1], cols, kind).reshape(rows[0], rows[1], -1)
    if kind == "F32":
        return np.ones(rows * cols, np.float32)
    if kind == "router":  # logits of spread ~1, so tokens spread over the experts
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if kind == "conv":  # the DeltaNet's short convolution
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if kind == "decay":  # -exp(A_log), as llama.cpp stores it: A between 1 and 16
        return -rng.uniform(1.0, 16.0, rows * cols).astype(np.float32)
    if kind == "bias":  # gpt-oss's biases and sinks: small
        values = (0.1 * rng.standard_normal(rows * cols)).astype(np.float32)
        return values if rows == 1 else values.reshape(rows, cols)
    return _blocks(rng, rows, cols, kind)


def main(args: argparse.Namespace) -> int:
    shape = dict(SHAPES[args.size])
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit("--layers must be >= 1")
        shape["layers"] = args.layers
    qtype, out = args.qtype.upper(), Path(args.out)
    if qtype not in ("Q4_0", "F16") and args.llama_quantize is None:
        raise SystemExit(f"--qtype {args.qtype} is made by llama.cpp's llama-quantize: "
                         "pass --llama-quantize PATH")
    if qtype in ("Q4_0", "F16"):
        write_model(shape, out, args.seed, float16=qtype == "F16")
    else:
        f16 = out.with_name(out.stem + ".f16.gguf")
        try:
            write_model(shape, f16, args.seed, float16=True)
            proc = subprocess.run([args.llama_quantize, str(f16), str(out), qtype], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                raise SystemExit(f"llama-quantize failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        finally:
            f16.unlink(missing_ok=True)
    family = ("Qwen3.5-MoE" if "v_heads" in shape else "gpt-oss" if "gpt_oss" in shape
              else "Qwen3-MoE" if "experts" in shape else "Llama")
    experts = " (MXFP4 experts)" if "gpt_oss" in shape else ""
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB): {family} {args.size} shape, "
          f"{shape['layers']} layers, random {qtype} weights{experts}; "
          f"serve it with: unison serve --model-path {out}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("make-model", help="write a GGUF of a real size (random weights) for speed figures")
    p.add_argument("--size", choices=sorted(SHAPES), default="1b",
                   help="Llama 3.2 1B / 3B, Qwen3-30B-A3B (a mixture of experts), Qwen3.5-35B-A3B "
                        "(linear attention, experts and a shared expert), or gpt-oss-20b (MXFP4 experts)")
    p.add_argument("--layers", type=int, default=None,
                   help="fewer layers than the shape's (30b-a3b with 12: about 4.5 GB)")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qtype", default="q4_0",
                   help="q4_0 (random blocks, the default), f16, or any type llama-quantize makes "
                        "(q4_k_m, q5_k_m, q6_k, iq4_xs, ...: needs --llama-quantize)")
    p.add_argument("--llama-quantize", default=None, metavar="PATH", help="llama.cpp's llama-quantize binary")
    p.set_defaults(func=main)
