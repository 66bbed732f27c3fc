"""Llama family, plain PyTorch: Llama 2/3, SmolLM, Mistral, Qwen2 (qkv bias), Qwen3 (qk-norm)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import cpu_kernels, quant
from .quant import QuantWeight
from .weights import DictWeights, WeightSource, linear_bits

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# attention(layer, q [N, heads, head_dim], k, v [N, kv_heads, head_dim]) -> [N, heads * head_dim]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        hf = _read_json(model_dir / "config.json")
        gen_file = model_dir / "generation_config.json"
        return cls.from_hf(hf, _read_json(gen_file) if gen_file.is_file() else {})

    @classmethod
    def from_hf(cls, hf: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported model architecture {archs}; "
                             f"supported: {list(ARCHITECTURES)}")
        if hf.get("use_sliding_window") and arch != "MistralForCausalLM":
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        heads = hf["num_attention_heads"]
        # transformers 5 keeps theta and scaling under rope_parameters; older configs at top level
        rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=hf.get("sliding_window") if arch == "MistralForCausalLM" else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_ids(hf.get("eos_token_id")) + _ids((gen or {}).get("eos_token_id")),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        )

    def __post_init__(self) -> None:
        self.eos_token_ids = list(dict.fromkeys(self.eos_token_ids))


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary frequencies after the config's rope scaling, computed as transformers does."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Linear:
    """y = x @ weight.T + bias. On CPU the weight is prepacked once for oneDNN, whose GEMMs run
    1.2-3x faster here than F.linear's at every batch size (decode, 64-way decode, prefill)."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.packed = _onednn_pack(weight)
        if self.packed is not None:
            self.weight = None  # the packed copy is all that is needed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


_ONEDNN: bool | None = None  # whether packed oneDNN linears work here; probed on first use


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    global _ONEDNN
    if weight.device.type != "cpu" or os.environ.get("UNISON_ONEDNN_LINEAR") == "0":
        return None
    if _ONEDNN is None:
        _ONEDNN = _probe_onednn()
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64) if _ONEDNN else None


def _probe_onednn() -> bool:
    # Private ops (torch.compile's CPU freezing uses them): check they exist and match F.linear.
    try:
        w, x = torch.randn(24, 16), torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        ok = torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError) as e:
        log.info("oneDNN packed linear unavailable (%s): using F.linear", e)
        return False
    if not ok:
        log.warning("oneDNN packed linear disagrees with F.linear: using F.linear")
    return ok


class QuantLinear:
    """y = x @ W.T (+ bias) with W in int4 / int8 blocks (quant.py), run by the C kernel.

    A fused linear (q|k|v, gate|up) may hold parts of different kinds: a GGUF can store v wider
    than q and k. The activations are quantized once for all parts."""

    __slots__ = ("parts", "bias", "kernels", "plan")

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, kernels: cpu_kernels.CpuKernels):
        self.parts, self.bias, self.kernels = parts, bias, kernels
        self.plan = cpu_kernels.QuantPlan(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.quant_linear(x, self.plan)
        return y if self.bias is None else y.add_(self.bias)

    @property
    def kind(self) -> str:
        return "+".join(dict.fromkeys(p.kind for p in self.parts))


class Embedding:
    """Token embeddings: a float table, or the quantized weight a tied LM head also runs on."""

    __slots__ = ("table", "quant", "kernels")

    def __init__(self, table: torch.Tensor | None, quantized: QuantWeight | None = None,
                 kernels: cpu_kernels.CpuKernels | None = None):
        self.table, self.quant, self.kernels = table, quantized, kernels

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.table)
        return self.kernels.dequantize_rows(self.quant, ids)

    @property
    def kind(self) -> str:
        return str(self.table.dtype).removeprefix("torch.") if self.quant is None else self.quant.kind

    @property
    def nbytes(self) -> int:
        return self.quant.nbytes if self.quant is not None else self.table.numel() * self.table.element_size()


def _nbytes(linear: Linear | QuantLinear) -> int:
    if isinstance(linear, QuantLinear):
        return sum(p.nbytes for p in linear.parts)
    w = linear.weight if linear.weight is not None else linear.packed
    return w.numel() * w.element_size() + (0 if linear.bias is None else linear.bias.numel() * 4)


def _kind(linear: Linear | QuantLinear) -> str:
    if isinstance(linear, QuantLinear):
        return linear.kind
    return str((linear.weight if linear.weight is not None else linear.packed).dtype).removeprefix("torch.")


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Linear | QuantLinear  # q, k, v projections fused: [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: Linear | QuantLinear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Linear | QuantLinear  # gate and up projections fused: [2 * intermediate, hidden]
    down: Linear | QuantLinear


class LlamaModel:
    """Weights as plain tensors and a forward over a flat batch of tokens; attention is supplied.

    `quantization` (none, int8 or int4, resolved by weights.resolve_quantization) picks the
    linears' kernels: oneDNN fp32, or the quantized C kernel on the source's blocks."""

    def __init__(self, cfg: ModelConfig, weights: WeightSource, device: torch.device,
                 dtype: torch.dtype, quantization: str = "none", from_gguf: bool = False):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        # The C kernels where they apply (CPU, float32); torch ops elsewhere.
        kernels = cpu_kernels.load() if device.type == "cpu" and dtype == torch.float32 else None
        self.ops: TorchOps | cpu_kernels.CpuKernels = kernels or TorchOps()
        get = _WeightGetter(weights, device, dtype, quantization, from_gguf, kernels)
        self.embed = get.embedding("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = get.head(self.embed) if tied else get.linear(["lm_head.weight"], head=True)
        self.layers = [self._layer(get, f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)]
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim

    @staticmethod
    def _layer(get: _WeightGetter, p: str) -> Layer:
        a, m = p + "self_attn.", p + "mlp."
        bias = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        return Layer(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=get.linear([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                           bias if get.has(bias[0]) else None),
            o_proj=get.linear([a + "o_proj.weight"]),
            q_norm=get(a + "q_norm.weight") if get.has(a + "q_norm.weight") else None,
            k_norm=get(a + "k_norm.weight") if get.has(a + "k_norm.weight") else None,
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=get.linear([m + "gate_proj.weight", m + "up_proj.weight"]),
            down=get.linear([m + "down_proj.weight"]),
        )

    def weights_bytes(self) -> int:
        """Bytes of the weights as executed (packed, quantized or not), norms included."""
        norms = [(layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm) for layer in self.layers]
        tensors = [self.norm] + [t for group in norms for t in group if t is not None]
        total = sum(t.numel() * t.element_size() for t in tensors) + self.embed.nbytes
        linears = [getattr(layer, n) for layer in self.layers for n in ("qkv", "o_proj", "gate_up", "down")]
        tied = isinstance(self.lm_head, QuantLinear) and self.lm_head.parts == [self.embed.quant]
        return total + sum(_nbytes(x) for x in linears) + (0 if tied else _nbytes(self.lm_head))

    def linear_kinds(self) -> dict[str, str]:
        """What each linear (and the embedding) runs as: float32, int8, int4 or a mix."""
        kinds = {"embed_tokens": self.embed.kind, "lm_head": _kind(self.lm_head)}
        for i, layer in enumerate(self.layers):
            for name in ("qkv", "o_proj", "gate_up", "down"):
                kinds[f"layers.{i}.{name}"] = _kind(getattr(layer, name))
        return kinds

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim / 2] for the given positions; computed once per step."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits [len(logits_rows), vocab] for the flat batch `input_ids`."""
        cfg, ops, qs, kvs, eps = self.cfg, self.ops, self.q_size, self.kv_size, self.cfg.rms_norm_eps
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.rope(positions)
        h = self.embed(input_ids)
        n = h.shape[0]
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            if layer.q_norm is not None:  # Qwen3: per-head norms before the rotation
                qkv[:, :qs] = rms_norm(qkv[:, :qs].view(n, heads, d), layer.q_norm, eps).view(n, qs)
                qkv[:, qs: qs + kvs] = rms_norm(qkv[:, qs: qs + kvs].view(n, kv_heads, d), layer.k_norm,
                                                eps).view(n, kvs)
            ops.rope_(qkv[:, : qs + kvs], heads + kv_heads, d, cos, sin)  # q and k heads, side by side
            q = qkv[:, :qs].view(n, heads, d)
            k = qkv[:, qs: qs + kvs].view(n, kv_heads, d)
            v = qkv[:, qs + kvs:].view(n, kv_heads, d)
            x = ops.add_rms_norm(h, layer.o_proj(attention(i, q, k, v)), layer.post_norm, eps)
            x = ops.add_rms_norm(h, layer.down(ops.silu_mul(layer.gate_up(x))), norms[i], eps)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)  # the LM head is costly: only rows that need logits
        return self.lm_head(x).float()


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
        x = x.view(x.shape[0], heads, head_dim)
        x.copy_(apply_rope(x, cos[:, None], sin[:, None]))

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The same operation order as transformers, so fp32 results match it bit for bit.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _WeightGetter:
    """Fetches checkpoint tensors by name: norms as float tensors on the model's device and dtype,
    linears as packed oneDNN weights or quantized blocks, per the model's quantization."""

    def __init__(self, weights: WeightSource, device: torch.device, dtype: torch.dtype,
                 quantization: str, from_gguf: bool, kernels: cpu_kernels.CpuKernels | None):
        self.weights, self.device, self.dtype = weights, device, dtype
        self.quantization, self.from_gguf, self.kernels = quantization, from_gguf, kernels

    def has(self, name: str) -> bool:
        return name in self.weights

    def __call__(self, name: str) -> torch.Tensor:
        return self.weights.float(name).to(device=self.device, dtype=self.dtype).contiguous()

    def _bits(self, name: str, head: bool = False) -> int | None:
        return linear_bits(self.quantization, self.weights.source_type(name), head=head,
                           from_gguf=self.from_gguf)

    def linear(self, names: list[str], bias: list[str] | None = None, head: bool = False
               ) -> Linear | QuantLinear:
        bias_t = torch.cat([self(b) for b in bias]) if bias else None
        bits = [self._bits(n, head) for n in names]
        if bits[0] is None:
            w = torch.cat([self.weights.float(n) for n in names])
            return Linear(w.to(device=self.device, dtype=self.dtype), bias_t)
        parts: list[QuantWeight] = []
        for name, b in zip(names, bits):
            w = self.weights.quantized(name, b)
            if parts and parts[-1].bits == b and parts[-1].n % quant.TILE == 0:
                parts[-1] = quant.concat([parts[-1], w])  # one kernel call for same-kind parts
            else:
                parts.append(w)
        return QuantLinear(parts, bias_t, self.kernels)

    def embedding(self, name: str) -> Embedding:
        bits = self._bits(name, head=True)
        if bits is None:
            return Embedding(self(name))
        return Embedding(None, self.weights.quantized(name, bits), self.kernels)

    def head(self, embed: Embedding) -> Linear | QuantLinear:
        """The LM head of a tied model: the embedding's own tensor, float or quantized."""
        if embed.quant is None:
            return Linear(embed.table)
        return QuantLinear([embed.quant], None, self.kernels)


def dummy_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[ModelConfig, LlamaModel]:
    """A tiny random model with the real vocabulary: the forward costs next to nothing, so
    benchmarks of the frontends are not limited by the model."""
    import dataclasses

    tiny = dataclasses.replace(cfg, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               tie_word_embeddings=True, qk_norm=False)
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (tiny.vocab_size, 64), "model.norm.weight": (64,),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.0.post_attention_layernorm.weight": (64,),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.weight": (32, 64),
        "model.layers.0.self_attn.v_proj.weight": (32, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
        "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.up_proj.weight": (128, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 128),
    }
    weights = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()}
    return tiny, LlamaModel(tiny, DictWeights(weights), device, dtype)
