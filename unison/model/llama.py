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

from . import cpu_kernels

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


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v projections fused: [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up projections fused: [2 * intermediate, hidden]
    down: Linear


class LlamaModel:
    """Weights as plain tensors and a forward over a flat batch of tokens; attention is supplied."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        get = _WeightGetter(weights, device, dtype)
        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = Linear(self.embed if tied else get("lm_head.weight"))
        self.layers = [self._layer(get, f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)]
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        # The C kernels where they apply (CPU, float32); torch ops elsewhere.
        kernels = cpu_kernels.load() if device.type == "cpu" and dtype == torch.float32 else None
        self.ops: TorchOps | cpu_kernels.CpuKernels = kernels or TorchOps()

    @staticmethod
    def _layer(get: _WeightGetter, p: str) -> Layer:
        a, m = p + "self_attn.", p + "mlp."
        bias = (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        return Layer(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=Linear(get.cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                       get.cat(*bias) if get.has(bias[0]) else None),
            o_proj=Linear(get(a + "o_proj.weight")),
            q_norm=get(a + "q_norm.weight") if get.has(a + "q_norm.weight") else None,
            k_norm=get(a + "k_norm.weight") if get.has(a + "k_norm.weight") else None,
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=Linear(get.cat(m + "gate_proj.weight", m + "up_proj.weight")),
            down=Linear(get(m + "down_proj.weight")),
        )

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
        h = F.embedding(input_ids, self.embed)
        n = h.shape[0]
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            if layer.q_norm is not None:  # Qwen3: per-head norms before the rotation
                qkv[:, :qs] = rms_norm(qkv[:, :qs].view(n, heads, d), layer.q_norm, eps).view(n, qs)
                qkv[:, qs: qs + kvs] = rms_norm(qkv[:, qs: qs + kvs].view(n, kv_heads, d), layer.k_norm,
                                                eps).view(n, kvs)
            ops.rope_(qkv[:, :qs], heads, d, cos, sin)
            ops.rope_(qkv[:, qs: qs + kvs], kv_heads, d, cos, sin)
            q = qkv[:, :qs].view(n, heads, d)
            k = qkv[:, qs: qs + kvs].view(n, kv_heads, d)
            v = qkv[:, qs + kvs:].view(n, kv_heads, d)
            x = ops.add_rms_norm(h, layer.o_proj(attention(i, q, k, v)), layer.post_norm, eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            x = ops.add_rms_norm(h, layer.down(F.silu(gate, inplace=True).mul_(up)), norms[i], eps)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The same operation order as transformers, so fp32 results match it bit for bit.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _WeightGetter:
    """Fetches checkpoint tensors by name, converted to the model's dtype and device."""

    def __init__(self, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.weights, self.device, self.dtype = weights, device, dtype

    def has(self, name: str) -> bool:
        return name in self.weights

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return self.weights[name]

    def __call__(self, name: str) -> torch.Tensor:
        return self.raw(name).to(device=self.device, dtype=self.dtype).contiguous()

    def cat(self, *names: str) -> torch.Tensor:
        return torch.cat([self.raw(n) for n in names]).to(device=self.device, dtype=self.dtype)


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files, on CPU in the checkpoint's dtype."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(f))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"cannot read weight file {f} (corrupt or truncated?): {e}") from e
    return weights


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
               cfg: ModelConfig | None = None) -> LlamaModel:
    cfg = cfg or ModelConfig.from_dir(model_dir)
    return LlamaModel(cfg, load_weights(model_dir), device, dtype)


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
    return tiny, LlamaModel(tiny, weights, device, dtype)
