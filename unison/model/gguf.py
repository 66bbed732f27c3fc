"""GGUF -> Hugging Face directory: dequantized fp32 safetensors, config.json, tokenizer files."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

# GGUF architecture -> (HF architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
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
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
log = logging.getLogger(__name__)


def open_gguf(path: Path):
    """A GGUFReader on `path`, or ValueError naming the file when it is not a readable GGUF."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy/struct raise on a truncated file
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {e}") from e


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                         f"supported: {sorted(ARCHITECTURES)}")
    return arch


def hf_config(reader) -> dict[str, Any]:
    arch = gguf_architecture(reader)

    def a(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": ARCHITECTURES[arch][1],
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
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
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if a("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    return config


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rows (x0, x_d/2, x1, ...) for its rope kernel.
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m[2] not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {name!r} in GGUF file")
    return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"


def hf_state_dict(reader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF name, q/k rows back in HF order."""
    from gguf.quants import dequantize

    permute = config["model_type"] == "llama"  # qwen use NeoX rope: no permutation in llama.cpp
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # llama 3.1+ rope scaling, as per-frequency factors
            log.warning("rope_freqs (llama3 rope scaling) is not converted: outputs may drift "
                        "from the original model's, mostly on long contexts")
            continue
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if permute and kind in heads:
            w = _unpermute(w, heads[kind])
        out[_hf_name(t.name)] = w
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face style model directory for `gguf_path` into the empty `out_dir`."""
    from safetensors.numpy import save_file

    reader = open_gguf(gguf_path)
    config = hf_config(reader)
    save_file(hf_state_dict(reader, config), str(out_dir / "model.safetensors"), {"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(reader, config))
    del reader  # release the mmap before transformers opens the file again
    _convert_tokenizer(gguf_path, out_dir, config["max_position_embeddings"])


def _generation_config(reader, config: dict[str, Any]) -> dict[str, Any]:
    # Chat models often end a turn with an end-of-turn token distinct from eos: stop on both.
    eos = [config["eos_token_id"], _field(reader, "tokenizer.ggml.eot_token_id")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    return {"bos_token_id": config["bos_token_id"],
            "eos_token_id": eos[0] if len(eos) == 1 else eos}


def _convert_tokenizer(gguf_path: Path, out_dir: Path, context_length: int) -> None:
    # transformers is used only here, once per file: it turns vocab + merges into tokenizer.json.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)
    cfg["model_max_length"] = context_length
    _write_json(path, cfg)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
