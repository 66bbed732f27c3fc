"""The model families Unison runs, each a declarative difference from the Llama decoder, and
ModelConfig: one model's shape, read from a Hugging Face config.json.

A decoder layer here is: [input norm] -> attention (q/k norms, rotary, a window or not)
-> [post-attention norm] -> residual -> [pre-MLP norm] -> gated MLP -> [post-MLP norm] ->
residual. A family says which norms exist and what the checkpoint calls them, the MLP's
activation, whether norm weights are stored as w for a (1 + w) scale, how embeddings are scaled,
and which layers attend within a window. decoder.py runs them all with one forward.

A mixture-of-experts family (Qwen3-MoE, Mixtral, OLMoE) replaces the gated MLP by a sparse one:
a router picks each token's top-k experts, each expert is a gated MLP of its own, and their
outputs are summed with the router's weights (moe.py). The family says where its checkpoint keeps
the router and the experts (`MoeNames`); the config says how many and how they combine
(`MoeConfig`).

Adding a family is a `Family` entry and, when its config spells things its own way, a few
lines in `ModelConfig.from_hf` (see Gemma 3's layer types and rope parameters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from unison.json_types import JSONObject

from .rope import Rope


@dataclass(frozen=True)
class MoeNames:
    """Where a sparse MLP lives in a family's checkpoint, under model.layers.N."""

    router: str  # the router's linear: [experts, hidden]
    experts: str  # expert e's projections are under f"{experts}.{e}."
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def expert(self, layer: int, e: int, proj: str) -> str:
        """The checkpoint name of expert e's `proj` (gate, up or down) weight in `layer`."""
        return f"model.layers.{layer}.{self.experts}.{e}.{getattr(self, proj)}.weight"

    def router_weight(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.router}.weight"


@dataclass(frozen=True)
class Family:
    name: str
    hf_architecture: str
    gguf_architecture: str | None  # GGUF's general.architecture, when GGUF files are read
    # Checkpoint names (under model.layers.N.) of the norms a layer has, by role.
    norms: dict[str, str] = field(default_factory=lambda: {
        "input": "input_layernorm", "pre_mlp": "post_attention_layernorm"})
    activation: str = "silu"  # of the gated MLP: silu | gelu_tanh
    norm_plus_one: bool = False  # weights stored as w, applied as (1 + w): Gemma
    embed_scale: bool = False  # embeddings times sqrt(hidden_size): Gemma
    qk_norm: str | None = None  # per "head" (Qwen3, Gemma 3) or over the "full" projection (OLMo 2)
    moe: MoeNames | None = None  # a sparse MLP in every layer instead of the dense one


LLAMA = Family("llama", "LlamaForCausalLM", "llama")
FAMILIES = [
    LLAMA,
    Family("mistral", "MistralForCausalLM", None),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2"),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm="head"),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3", activation="gelu_tanh", norm_plus_one=True,
           embed_scale=True, qk_norm="head",
           norms={"input": "input_layernorm", "post_attention": "post_attention_layernorm",
                  "pre_mlp": "pre_feedforward_layernorm", "post_mlp": "post_feedforward_layernorm"}),
    Family("olmo2", "Olmo2ForCausalLM", None, qk_norm="full",
           norms={"post_attention": "post_attention_layernorm", "post_mlp": "post_feedforward_layernorm"}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", qk_norm="head",
           moe=MoeNames("mlp.gate", "mlp.experts")),
    # GGUF writes Mixtral as "llama" with expert tensors (gguf.py tells them apart).
    Family("mixtral", "MixtralForCausalLM", None,
           moe=MoeNames("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")),
    Family("olmoe", "OlmoeForCausalLM", "olmoe", qk_norm="full", moe=MoeNames("mlp.gate", "mlp.experts")),
]
BY_ARCHITECTURE = {f.hf_architecture: f for f in FAMILIES}
BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}
SUPPORTED = sorted(BY_ARCHITECTURE)


def family_of(architectures: list[str] | None, where: str = "") -> Family:
    """The family of an HF config's `architectures`, or a clear error listing the supported ones."""
    for arch in architectures or []:
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    at = f" in {where}" if where else ""
    raise ValueError(f"unsupported model architecture {architectures}{at}; supported: {SUPPORTED}")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A sparse MLP's shape: each token runs `top_k` of `num_experts` gated MLPs of
    `intermediate_size`, weighted by the router's softmax (renormalized over the chosen
    experts when `norm_topk_prob`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool

    @classmethod
    def from_hf(cls, family: Family, hf: JSONObject) -> MoeConfig:
        arch = family.hf_architecture
        # Variants with parts this MLP lacks are refused by name rather than run wrongly.
        for key in ("shared_expert_intermediate_size", "n_shared_experts", "n_group", "topk_group"):
            if hf.get(key):
                raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported (shared experts and "
                                 "grouped routing are not run)")
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{arch} with dense layers (mlp_only_layers={hf.get('mlp_only_layers')}, "
                             f"decoder_sparse_step={hf.get('decoder_sparse_step')}) is not supported")
        experts = _positive(arch, "num_experts", hf.get("num_experts") or hf.get("num_local_experts"))
        top_k = _positive(arch, "num_experts_per_tok", hf.get("num_experts_per_tok"))
        size = _positive(arch, "moe_intermediate_size",
                         hf.get("moe_intermediate_size") or hf.get("intermediate_size"))
        if experts > 1024:  # the kernel's bound (csrc/moe.c); no released model comes near it
            raise ValueError(f"{arch}: num_experts ({experts}) is over 1024, which is not supported")
        if top_k > experts:
            raise ValueError(f"{arch}: num_experts_per_tok ({top_k}) exceeds num_experts ({experts})")
        if size % 8 or hf["hidden_size"] % 8:
            raise ValueError(f"{arch}: the experts' sizes (moe_intermediate_size {size}, hidden_size "
                             f"{hf['hidden_size']}) must be multiples of 8")
        # Mixtral always renormalizes the top-k weights; Qwen3-MoE and OLMoE say so in the config.
        norm = True if family.name == "mixtral" else bool(hf.get("norm_topk_prob", False))
        return cls(experts, top_k, size, norm)


@dataclass(slots=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    ropes: list[Rope]  # the distinct rotary embeddings; layer i uses ropes[layer_rope[i]]
    layer_rope: list[int]
    layer_window: list[int | None]  # sliding window of each layer (None: attends to everything)
    attention_scale: float
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    moe: MoeConfig | None = None  # the sparse MLP of a mixture-of-experts family

    @property
    def architecture(self) -> str:
        return self.family.hf_architecture

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @property
    def windows(self) -> list[int | None]:
        """The distinct windows of the layers, in order of first use."""
        return list(dict.fromkeys(self.layer_window))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        hf = _read_json(model_dir / "config.json")
        gen_file = model_dir / "generation_config.json"
        return cls.from_hf(hf, _read_json(gen_file) if gen_file.is_file() else {})

    @classmethod
    def from_hf(cls, hf: JSONObject, gen: JSONObject | None = None) -> ModelConfig:
        family = family_of(hf.get("architectures"))
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "clip_qkv"):
            if hf.get(key) is not None:
                raise ValueError(f"{family.hf_architecture} with {key} is not supported")
        heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        positions = hf.get("max_position_embeddings", 4096)
        ropes, layer_rope, windows = _attention_layout(family, hf, head_dim, layers, positions)
        scalar = hf.get("query_pre_attn_scalar") if family.name == "gemma3" else None
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=positions,
            ropes=ropes,
            layer_rope=layer_rope,
            layer_window=windows,
            attention_scale=(scalar or head_dim) ** -0.5,
            tie_word_embeddings=hf.get("tie_word_embeddings", family.name == "gemma3"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_ids(hf.get("eos_token_id")) + _ids((gen or {}).get("eos_token_id")),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            moe=MoeConfig.from_hf(family, hf) if family.moe else None,
        )

    def __post_init__(self) -> None:
        self.eos_token_ids = list(dict.fromkeys(self.eos_token_ids))


def _attention_layout(family: Family, hf: JSONObject, head_dim: int, layers: int,
                      positions: int) -> tuple[list[Rope], list[int], list[int | None]]:
    """(distinct ropes, each layer's rope, each layer's window) from an HF config."""
    factors = tuple(hf["rope_freqs"]) if hf.get("rope_freqs") else None  # written by gguf.py
    if family.name == "gemma3":
        # Gemma 3: five sliding-window layers for each global one, with their own rope thetas
        # (transformers 5: rope_parameters keyed by layer type; older: rope_local_base_freq).
        types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
            for i in range(layers)]
        params = hf.get("rope_parameters") or {}
        if "full_attention" not in params:
            full = {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
            params = {"full_attention": full,
                      "sliding_attention": {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}}
        kinds = ["full_attention", "sliding_attention"]
        ropes = [Rope.from_params(head_dim, params[k], positions) for k in kinds]
        layer_rope = [kinds.index(t) for t in types]
        windows = [hf.get("sliding_window") if t == "sliding_attention" else None for t in types]
        return ropes, layer_rope, windows
    # transformers 5 keeps theta and scaling under rope_parameters; older configs at top level
    params = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {}),
              **(hf.get("rope_parameters") or {})}
    rope = Rope.from_params(head_dim, params, positions)
    if factors is not None:
        rope = Rope(rope.head_dim, rope.theta, rope.scaling, factors, positions)
    windowed = family.name in ("mistral", "mixtral")
    if hf.get("use_sliding_window") and not windowed:
        raise ValueError(f"{family.hf_architecture} with use_sliding_window=true is not supported")
    window = hf.get("sliding_window") if windowed else None
    return [rope], [0] * layers, [window] * layers


def _positive(arch: str, name: str, value: object) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{arch}: {name} must be a positive integer, got {value!r}")
    return value


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _read_json(path: Path) -> JSONObject:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
