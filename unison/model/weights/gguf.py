"""GGUF files: the config and tokenizer as a Hugging Face directory, the weights read in place.

`convert_gguf` writes config.json, generation_config.json and the tokenizer files (the cache
directory the core and every frontend read). `GGUFWeights` serves the tensors under their
Hugging Face names straight from the file's mmap, one at a time: as float32 for the reference
path (gguf's own dequantization, as transformers' GGUF loader), or converted into the quantized
kernel's blocks (quant.py) without a float copy of the whole tensor. Pages of the file are
released once a tensor is converted, so the file is never resident beside its converted weights.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unison.json_types import JSONObject
from unison.model.families import BY_ARCHITECTURE, BY_GGUF, Family
from unison.model.weights import gguf_blocks, quant
from unison.model.weights.disk_cache import cache_root, cached_dir
from unison.model.weights.gguf_header import GGUFHeader, fields_digest, open_gguf
from unison.model.weights.quant import BlockQuant, QuantWeight

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # Llama's pre-MLP norm; Gemma 3's, see _GEMMA3_NAMES
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Qwen3-Next and Qwen3.5 (llama.cpp's qwen3next, qwen35, qwen35moe): the pre-MLP norm is named
# post_attention_norm, and the Gated DeltaNet's tensors ssm_* (Qwen3-Next's q|k|v and z apart).
_HYBRID_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                 "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                 "ssm_ba": "linear_attn.in_proj_ba", "ssm_beta": "linear_attn.in_proj_b",
                 "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d",
                 "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
# gpt-oss (llama.cpp's gpt-oss): the pre-MLP norm is post_attention_norm; attn_sinks.weight is
# the attention's sinks (no .weight in the Hugging Face name).
_GPT_OSS_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"}
_SHARED_NAMES = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                 "ffn_down_shexp": "mlp.shared_expert.down_proj",
                 "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Tensors named without a .weight: the decay, stored as -exp(A_log), and the time step's bias.
_BARE_NAMES = {"ssm_a": "linear_attn.neg_A", "ssm_dt.bias": "linear_attn.dt_bias"}
_BARE_RE = re.compile(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)")
_HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")
# A mixture of experts keeps each projection of all its experts in one tensor [experts, rows, k].
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
_SHARED_EXPERT_RE = re.compile(r"blk\.\d+\.ffn_\w+_(shexp|chexps)\.weight")
# Bump when the tokenizer conversion's output changes, so stale cached tokenizers are not reused
# (and loader.CACHE_FORMAT with it: a model's converted directory holds a copy).
TOKENIZER_CACHE_FORMAT = 1
# Fields that describe a file's weights only: llama-quantize's type and imatrix, a split's parts.
WEIGHT_FIELDS = ("general.file_type", "general.quantization_version", "quantize.", "split.")


SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # llama-gguf-split's parts


def split_parts(path: Path) -> list[Path]:
    """A split GGUF's parts in order, from its first part's name (a whole file: itself). The
    first part holds the metadata; every part holds some of the tensors."""
    m = SPLIT_NAME.search(path.name)
    if m is None:
        return [path]
    if m[1] != "00001":
        raise ValueError(f"{path.name} is part {int(m[1])} of a split GGUF: name its first part "
                         f"({path.name[:m.start()]}-00001-of-{m[2]}.gguf)")
    stem = path.name[:m.start()]
    parts = [path.with_name(f"{stem}-{i:05d}-of-{m[2]}.gguf") for i in range(1, int(m[2]) + 1)]
    if missing := [p.name for p in parts if not p.is_file()]:
        raise FileNotFoundError(f"{path.name}: the split GGUF's parts {missing} are not beside it")
    return parts


def _field(header: GGUFHeader, key: str, default: Any = None) -> Any:  # Any: a header field, as stored
    return header.fields.get(key, default)


def gguf_architecture(header: GGUFHeader) -> str:
    arch = _field(header, "general.architecture")
    if arch not in BY_GGUF:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(BY_GGUF)}")
    return arch


def gguf_family(header: GGUFHeader) -> Family:
    """The family of the file: its architecture's, except that llama.cpp writes Mixtral as
    "llama" with experts."""
    arch = gguf_architecture(header)
    if arch == "llama" and _field(header, "llama.expert_count"):
        return BY_ARCHITECTURE["MixtralForCausalLM"]
    return BY_GGUF[arch]


def hf_config(header: GGUFHeader) -> JSONObject:
    """A Hugging Face config.json for the file, as transformers' GGUF loader builds it."""
    arch = gguf_architecture(header)

    def a(key: str, default: Any = None) -> Any:  # Any: a header field, as stored
        return _field(header, f"{arch}.{key}", default)

    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    names = {t.name for t in header.tensors}
    vocab = a("vocab_size") or _field(header, "tokenizer.ggml.tokens")  # an array: its length
    family = gguf_family(header)
    config = {
        "architectures": [family.hf_architecture],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length", 0) or a("expert_feed_forward_length", 0)),
        # A Qwen3.5 file counts its multi-token-prediction block as a layer; the decoder's are the rest
        "num_hidden_layers": int(a("block_count")) - int(a("nextn_predict_layers", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": _field(header, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(header, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if a("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    if a("rope.scaling.type") == "yarn":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": float(a("rope.scaling.factor")),
                                  "original_max_position_embeddings":
                                      int(a("rope.scaling.original_context_length"))}
    if arch in _HYBRID_ARCHS:
        config.update(_linear_attention_config(arch, a, config["head_dim"]))
    if arch in ("qwen3vl", "qwen3vlmoe") and any(a("rope.dimension_sections") or []):  # M-RoPE: images' rows
        config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"),
                                     "mrope_section": list(a("rope.dimension_sections")[:3])}
    if arch == "gpt-oss":  # GptOssConfig's own defaults where the file says nothing, as transformers
        window, layers = int(a("attention.sliding_window", 128)), config["num_hidden_layers"]
        config.update(sliding_window=window, rope_scaling=None, layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            rope_parameters={"rope_type": "yarn", "rope_theta": config.pop("rope_theta"),
                             "factor": float(a("rope.scaling.factor", 32.0)), "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings":
                                 int(a("rope.scaling.original_context_length", 4096))})
    if arch == "gemma3":  # Gemma3TextConfig's defaults where the file says nothing, as transformers
        layers, window = config["num_hidden_layers"], a("attention.sliding_window")
        config.update(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=256, sliding_window=window, hidden_act="gelu_pytorch_tanh",
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                   for i in range(layers)],
                      rope_parameters={"full_attention": {"rope_type": "default",
                                                          "rope_theta": config.pop("rope_theta")},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    elif a("attention.sliding_window") and arch != "gpt-oss":  # Mistral (or Mixtral), written as llama
        if family.moe is None:
            config.update(architectures=["MistralForCausalLM"], model_type="mistral")
        config.update(sliding_window=int(a("attention.sliding_window")))
    if family.moe is not None:
        config.update(_moe_config(family, a))
    return config


def _linear_attention_config(arch: str, a: Callable[..., Any], head_dim: int) -> JSONObject:
    """A hybrid's Gated DeltaNet shape, from llama.cpp's ssm.* keys: state_size is the key head
    dim, group_count the key heads, time_step_rank the value heads, inner_size their total width.
    Its converter reorders a Qwen3.5's value heads so that head h reads key head h % key heads
    (where there are more value heads than key heads): `linear_value_heads_tiled`."""
    k_heads, v_heads = int(a("ssm.group_count")), int(a("ssm.time_step_rank"))
    sections = a("rope.dimension_sections") or []
    return {"linear_conv_kernel_dim": int(a("ssm.conv_kernel")),
            "linear_key_head_dim": int(a("ssm.state_size")), "linear_num_key_heads": k_heads,
            "linear_num_value_heads": v_heads,
            "linear_value_head_dim": int(a("ssm.inner_size")) // v_heads,
            "full_attention_interval": int(a("full_attention_interval", 4)),
            "partial_rotary_factor": int(a("rope.dimension_count", head_dim)) / head_dim,
            "linear_value_heads_tiled": arch != "qwen3next" and v_heads != k_heads,
            # Qwen3.5's M-RoPE: (time, rows, columns) frequency counts, for images' rows
            **({"rope_parameters": {"mrope_section": list(sections[:3])}} if any(sections) else {})}


def _moe_config(family: Family, a: Callable[..., Any]) -> JSONObject:  # a: reads a header field (Any)
    """A mixture of experts' fields, as the family's HF config names them. llama.cpp
    renormalizes the top-k weights of Qwen3-MoE, Mixtral, Qwen3-Next and Qwen3.5 and not those of
    OLMoE or Qwen2-MoE, unless the file says (expert_weights_norm)."""
    assert family.moe is not None
    shared = a("expert_shared_feed_forward_length")
    if (a("expert_shared_count") or shared) and family.moe.shared is None:
        raise ValueError(f"GGUF {family.name} with shared experts is not supported")
    if a("expert_gating_func") not in (None, 1):  # 1: softmax; 2: sigmoid (DeepSeek V3's routing)
        raise ValueError(f"GGUF expert_gating_func {a('expert_gating_func')} is not supported (softmax only)")
    config = {"num_experts": int(a("expert_count")), "num_experts_per_tok": int(a("expert_used_count", 0)),
              "norm_topk_prob": bool(a("expert_weights_norm", family.name not in ("olmoe", "qwen2_moe")))}
    if shared:
        config["shared_expert_intermediate_size"] = int(shared)
    if a("expert_feed_forward_length"):
        config["moe_intermediate_size"] = int(a("expert_feed_forward_length"))
    if family.name in ("mixtral", "gpt_oss"):
        config["num_local_experts"] = config.pop("num_experts")
    return config


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rows (x0, x_d/2, x1, ...) for its rope kernel.
    # Rows are whole output channels, so this also applies to raw quantized rows.
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, family: Family) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if (bare := _BARE_RE.fullmatch(name)) and family.linear_attention:
        return f"model.layers.{bare[1]}.{_BARE_NAMES[bare[2]]}"
    names = (_GEMMA3_NAMES if family.name == "gemma3" else _HYBRID_NAMES if family.linear_attention
             else _GPT_OSS_NAMES if family.name == "gpt_oss" else _LAYER_NAMES)
    if family.moe is not None:
        names = {**names, "ffn_gate_inp": family.moe.router}
        if family.moe.shared is not None:
            names |= _SHARED_NAMES
    if _SHARED_EXPERT_RE.fullmatch(name) and name.split(".")[2] not in names:
        raise ValueError(f"GGUF tensor {name!r}: shared experts are not supported")
    m = _LAYER_RE.fullmatch(name)
    if m is not None and m[2] == "attn_sinks" and family.attention_sinks:
        return f"model.layers.{m[1]}.self_attn.sinks"
    if m is None or m[2] not in names:
        raise ValueError(f"unexpected tensor {name!r} in GGUF file")
    return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"


_NUMPY_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(slots=True)
class _Tensor:
    name: str  # the GGUF name
    type_name: str  # "Q4_K", "F32", ...
    dims: tuple[int, ...]  # GGUF's order: innermost first
    offset: int
    n_bytes: int
    data: np.ndarray  # a view of the mmap: typed for float / int types, else [rows, row bytes]
    part: int = 0  # the file it is in, of a split GGUF's parts


class GGUFWeights:
    """A GGUF file's tensors under their Hugging Face names, read from an mmap on demand."""

    def __init__(self, path: str | Path, config: JSONObject | None = None) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        parts = split_parts(self.path)  # [path], or a split GGUF's parts in order
        headers = [open_gguf(p) for p in parts]
        header = GGUFHeader(headers[0].fields, [t for h in headers for t in h.tensors])  # as one file
        config = config or hf_config(header)
        arch, family = _field(header, "general.architecture"), gguf_family(header)
        # llama.cpp permutes q/k rows for its rope on llama only (the others use NeoX rope).
        permute = arch == "llama"
        # llama.cpp's converter stores Gemma's, Qwen3-Next's and Qwen3.5's norms as (1 + w) (but
        # the DeltaNet's ssm_norm, which is applied as is): served as w, as transformers does.
        self._norm_minus_one = arch == "gemma3" or arch in _HYBRID_ARCHS
        self._heads = {"attn_q": config["num_attention_heads"],
                       "attn_k": config["num_key_value_heads"]} if permute else {}
        self._maps = [np.memmap(p, mode="r") for p in parts]
        self.tensors: dict[str, _Tensor] = {}
        self.rope_freqs: np.ndarray | None = None  # llama 3.1+ rope scaling, per-frequency divisors
        # A Qwen3.5 file's multi-token-prediction blocks come after the decoder's: not run
        mtp_from = config["num_hidden_layers"] if _field(header, f"{arch}.nextn_predict_layers") else None
        for part, info in ((i, info) for i, h in enumerate(headers) for info in h.tensors):
            in_block = _BLOCK_RE.match(info.name)
            if mtp_from is not None and in_block and int(in_block[1]) >= mtp_from:
                continue
            try:
                kind = GGMLQuantizationType(info.type_id)
            except ValueError:
                raise ValueError(f"GGUF tensor {info.name!r} has type id {info.type_id}, which the "
                                 "gguf package does not know; update gguf or re-quantize the file") from None
            block, type_size = GGML_QUANT_SIZES[kind]
            n = int(np.prod(info.dims))
            shape = tuple(reversed(info.dims))
            dtype = _NUMPY_TYPES.get(kind.name, np.uint8)
            if dtype is np.uint8:  # quantized: rows of blocks
                if shape[-1] % block:
                    raise ValueError(f"GGUF tensor {info.name!r}: {shape[-1]} columns are not whole "
                                     f"{kind.name} blocks of {block}")
                shape = (*shape[:-1], shape[-1] // block * type_size)
            n_bytes = n * type_size // block
            if info.offset + n_bytes > len(self._maps[part]):
                raise ValueError(f"GGUF tensor {info.name!r} runs past the end of {parts[part]} (truncated?)")
            data = self._maps[part][info.offset: info.offset + n_bytes].view(dtype).reshape(shape)
            tensor = _Tensor(info.name, kind.name, info.dims, info.offset, n_bytes, data, part)
            if info.name == "rope_freqs.weight":
                self.rope_freqs = np.array(data, dtype=np.float32)
            elif (m := _EXPERT_RE.fullmatch(info.name)) and family.moe is not None:
                self.tensors |= _split_experts(tensor, int(m[1]), m[2], family, m[3])
            else:
                self.tensors[_hf_name(info.name, family)] = tensor
        if family.moe is not None:
            _check_experts(self, header, family, config)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def file_name(self, name: str) -> str | None:
        """The GGUF name (llama.cpp's) of the Hugging Face name `name`, for errors: present or not."""
        if name in self.tensors:
            return self.tensors[name].name
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?", name)
        if m is None:
            return next((g for g, h in _GLOBAL_NAMES.items() if h == name), None)
        names = {**_HYBRID_NAMES, **_SHARED_NAMES}
        kind = next((g for g, h in names.items() if h == m[2]), None)
        bare = next((g for g, h in _BARE_NAMES.items() if h == m[2]), None)
        return f"blk.{m[1]}.{bare}" if bare else f"blk.{m[1]}.{kind}.{m[3]}" if kind and m[3] else None

    def names(self) -> set[str]:
        return set(self.tensors)

    def source_type(self, name: str) -> str:
        return self._tensor(name).type_name

    def _tensor(self, name: str) -> _Tensor:
        if name not in self.tensors:
            raise ValueError(f"{self.path} is missing weight {name!r}")
        return self.tensors[name]

    def _rows(self, t: _Tensor) -> np.ndarray:
        """The tensor's raw rows (output channels), q/k rows back in Hugging Face order."""
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in self._heads and t.data.ndim == 2:
            return _unpermute(t.data, self._heads[kind])
        return t.data

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._tensor(name).dims))

    def float(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32 (a copy, off the mmap)."""
        t = self._tensor(name)
        w = np.array(_dequantize(t, self._rows(t)), np.float32)
        if self._norm_minus_one and t.name.endswith("norm.weight") and ".ssm_norm." not in t.name:
            w -= 1
        self._release(t)
        return torch.from_numpy(w).reshape(self.shape(name))

    def quantized(self, name: str, bits: int) -> QuantWeight:
        """The [n, k] tensor for the kernels, converted a slice of rows at a time: a GGUF block
        format as stored (gguf_blocks.py, whatever `bits`), Q4_0 / Q4_1 into int4 records exactly,
        float tensors quantized to `bits`; any other type refused by name."""
        t = self._tensor(name)
        n, k = self.shape(name)
        rows = self._rows(t)
        if t.type_name in gguf_blocks.FORMATS:
            weight = gguf_blocks.pack(t.type_name, n, k, lambda r0, r1: np.ascontiguousarray(rows[r0:r1]))
        elif t.type_name in quant.GGUF_INT4_TYPES:
            decode = _q4_0 if t.type_name == "Q4_0" else _q4_1
            wide = bits == 8  # (int8 asked for: the same values, widened)

            def convert(r0: int, r1: int) -> BlockQuant:
                bq = decode(np.ascontiguousarray(rows[r0:r1]))
                return BlockQuant(8, bq.q.astype(np.int8), bq.d, bq.min()) if wide else bq

            # Q4_0 keeps its 4.5 bits: its m (-8 d) is left out of the records, for the kernel to compute.
            weight = quant.pack(n, k, bits, convert, symmetric=t.type_name == "Q4_0" and not wide)
        elif t.type_name in gguf_blocks.FLOAT_TYPES:
            quantize = quant.QUANTIZERS[bits]
            weight = quant.pack(n, k, bits, lambda r0, r1: quantize(_dequantize(t, rows[r0:r1])))
        else:
            raise gguf_blocks.refusal(t.name, t.type_name)
        self._release(t)
        return weight

    def check_runnable(self) -> None:
        """A ValueError naming the first tensor whose type the kernels cannot run (before anything
        is converted)."""
        for t in self.tensors.values():
            if t.type_name not in gguf_blocks.RUNNABLE and t.type_name not in _NUMPY_TYPES:
                raise gguf_blocks.refusal(t.name, t.type_name)

    def _release(self, t: _Tensor) -> None:
        """Drop the tensor's file pages from this process (they stay in the page cache), so the
        file is never resident beside its converted weights."""
        mm = getattr(self._maps[t.part], "_mmap", None)
        if mm is None:
            return
        start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, min(len(mm), t.offset + t.n_bytes) - start)
        except (OSError, ValueError, AttributeError):
            pass


def _split_experts(t: _Tensor, layer: int, proj: str, family: Family,
                   kind: str = "weight") -> dict[str, _Tensor]:
    """A stacked expert tensor [experts, rows, k] (a bias: [experts, rows], gpt-oss's) as one
    tensor per expert, under the names the family's checkpoints give them: views of the file,
    nothing copied."""
    if len(t.dims) != (3 if kind == "weight" else 2):
        raise ValueError(f"GGUF tensor {t.name!r} has dims {list(t.dims)}: expected "
                         + ("3 (k, rows, experts)" if kind == "weight" else "2 (rows, experts)"))
    experts, per_expert = t.dims[-1], t.n_bytes // t.dims[-1]
    assert family.moe is not None  # (a mixture-of-experts family's tensors)
    name = family.moe.expert if kind == "weight" else family.moe.expert_bias
    return {name(layer, e, proj): _Tensor(
        f"{t.name}[{e}]", t.type_name, t.dims[:-1], t.offset + e * per_expert, per_expert, t.data[e], t.part)
        for e in range(experts)}


def _check_experts(weights: GGUFWeights, header: GGUFHeader, family: Family, config: JSONObject) -> None:
    """Every layer's router and expert tensors, present and of the shapes the metadata gives,
    or a ValueError naming the tensor (before anything is converted)."""
    hidden = config["hidden_size"]
    experts = config.get("num_experts") or config["num_local_experts"]
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    present = {t.name: t for t in header.tensors}
    expected = {"ffn_gate_inp": (hidden, experts), "ffn_gate_exps": (hidden, size, experts),
                "ffn_up_exps": (hidden, size, experts), "ffn_down_exps": (size, hidden, experts)}
    for layer in range(config["num_hidden_layers"]):
        for kind, dims in expected.items():
            name = f"blk.{layer}.{kind}.weight"
            if name not in present:
                raise ValueError(f"{weights.path}: GGUF tensor {name!r} is missing (a {family.name} "
                                 f"layer needs its router and its experts' gate, up and down)")
            if tuple(present[name].dims) != dims:
                raise ValueError(f"{weights.path}: GGUF tensor {name!r} has dims {list(present[name].dims)}, "
                                 f"expected {list(dims)} (hidden {hidden}, expert_feed_forward_length "
                                 f"{size}, expert_count {experts})")


def _dequantize(t: _Tensor, raw: np.ndarray) -> np.ndarray:
    """gguf's own dequantization: what transformers' GGUF loader computes, bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if t.type_name in _NUMPY_TYPES:
        return raw.astype(np.float32)
    try:
        return dequantize(raw, GGMLQuantizationType[t.type_name])
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.type_name}, which the gguf package "
                         "cannot read; re-quantize the file to a common type (Q4_K, Q8_0, ...)") from None


# ---- Q4_0 / Q4_1 -> int4 records, exactly ----------------------------------------------------

def _fp16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _q4_0(raw: np.ndarray) -> BlockQuant:  # d, 16 bytes: element j low nibble, j + 16 high
    b = raw.reshape(raw.shape[0], -1, 18)
    d = _fp16(b[..., :2])
    qs = b[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(raw.shape[0], -1)
    return BlockQuant(4, q, d, None)  # w = d (q - 8): m = -8 d, implied (BlockQuant.min)


def _q4_1(raw: np.ndarray) -> BlockQuant:  # d, m, 16 bytes of nibbles as Q4_0
    b = raw.reshape(raw.shape[0], -1, 20)
    qs = b[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(raw.shape[0], -1)
    return BlockQuant(4, q, _fp16(b[..., :2]), _fp16(b[..., 2:4]))


# ---- the config and tokenizer as a directory ----------------------------------------------------

def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json and tokenizer files for `gguf_path` into the
    empty `out_dir`. The weights stay in the GGUF file (GGUFWeights reads them)."""
    config = write_config(gguf_path, out_dir)  # first: an unsupported family fails in milliseconds
    _convert_tokenizer(gguf_path, out_dir, config["max_position_embeddings"])


def write_config(gguf_path: Path, out_dir: Path) -> JSONObject:
    """config.json and generation_config.json for `gguf_path`; returns the config."""
    header = open_gguf(gguf_path)
    config = hf_config(header)
    freqs = GGUFWeights(gguf_path, config).rope_freqs
    if freqs is not None:  # read by families.ModelConfig with the rest of the rope
        config["rope_freqs"] = freqs.tolist()
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(header, config))
    return config


def _generation_config(header: GGUFHeader, config: JSONObject) -> JSONObject:
    # Chat models often end a turn with an end-of-turn token distinct from eos: stop on both.
    eos = [config["eos_token_id"], _field(header, "tokenizer.ggml.eot_token_id")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    return {"bos_token_id": config["bos_token_id"],
            "eos_token_id": eos[0] if len(eos) == 1 else eos}


def _convert_tokenizer(gguf_path: Path, out_dir: Path, context_length: int) -> None:
    """The tokenizer files for `gguf_path`, converted once for all the files that differ from it in
    their weights alone (another quantization of the model, a file whose weights changed): the
    cache is keyed by the file's other fields, so they copy the files instead (12 s of converting
    for a Gemma vocabulary here)."""
    done = cached_dir(cache_root() / f"gguf-tokenizers-v{TOKENIZER_CACHE_FORMAT}" /
                      _tokenizer_key(gguf_path, context_length),
                      lambda tmp: _write_tokenizer(gguf_path, tmp, context_length))
    shutil.copytree(done, out_dir, dirs_exist_ok=True)


def _tokenizer_key(gguf_path: Path, context_length: int) -> str:
    """What the converted files depend on: the tokenizer's fields and the architecture where the
    conversion names the tokenizer's type (transformers then reads nothing else), else every field
    but WEIGHT_FIELDS (it reads the model's config, whose name alone can change the tokenizer's
    class); the context length; the versions of transformers and tokenizers."""
    from importlib.metadata import version

    header = open_gguf(gguf_path)
    named = _tokenizer_type(gguf_architecture(header))

    def read(key: str) -> bool:  # by transformers' conversion
        if named:
            return key.startswith("tokenizer.") or key == "general.architecture"
        return not key.startswith(WEIGHT_FIELDS)

    fields = fields_digest(gguf_path, header, read)
    versions = f"{version('transformers')}:{version('tokenizers')}"
    return hashlib.sha256(f"{named}:{fields}:{context_length}:{versions}".encode()).hexdigest()


def _write_tokenizer(gguf_path: Path, out_dir: Path, context_length: int) -> None:
    # transformers is used only here, once per tokenizer: it turns vocab + merges into tokenizer.json.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    named = _tokenizer_type(gguf_architecture(open_gguf(gguf_path)))
    # The file alone in a directory: from_pretrained would also read tokenizer files lying beside it,
    # which the cache's key does not cover (the GGUF's own tokenizer is the model's). Made beside
    # the directory being built, in the cache: nothing of ours is left in /tmp, even for a moment.
    with tempfile.TemporaryDirectory(prefix=".alone-", dir=out_dir.parent) as alone:
        os.symlink(gguf_path.resolve(), Path(alone, gguf_path.name))
        try:
            tok = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_path.name,
                                                **({"tokenizer_type": named} if named else {}))
        except (ValueError, TypeError) as e:  # a config transformers' GGUF loader cannot read: an
            # architecture it lacks (OLMoE), or gpt-oss's rope.scaling keys (transformers 5.25 takes
            # a field's first part, not its value): the tokenizer alone, which does not depend on them
            if isinstance(e, ValueError) and "not supported" not in str(e):
                raise
            tok = PreTrainedTokenizerFast.from_pretrained(alone, gguf_file=gguf_path.name)
    tok.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)
    cfg["model_max_length"] = context_length
    _write_json(path, cfg)


def _tokenizer_type(arch: str) -> str | None:
    """The model type whose tokenizer class AutoTokenizer picks for a file of `arch`, where naming
    it spares transformers reading the file's config through gguf's reader, which walks every
    vocabulary string in Python: 12.6 s of the 15.6 s a Gemma 3 file (262k tokens) took, for the
    same files. None where transformers reads the config fast anyway, where its GGUF loader does not
    know the architecture (the fallback below), or where this transformers lacks the tables."""
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    except ImportError:
        return None
    hf_class = BY_GGUF[arch].hf_architecture
    model_type = next((t for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if c == hf_class), None)
    if arch in GGUF_CONFIG_ARCHS or model_type is None or not TOKENIZER_MAPPING_NAMES.get(model_type):
        return None
    return model_type if {arch, model_type} & set(GGUF_SUPPORTED_ARCHITECTURES) else None


def _write_json(path: Path, obj: JSONObject) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
