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

Some MoE families (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE) add a shared expert: a dense gated MLP
that every token runs, scaled by a sigmoid gate of its own and added to the routed experts' sum.

gpt-oss adds biases (router, experts, q, k, v and o), a clamped SwiGLU, learned attention sinks
(one more logit per head in each softmax's denominator), and stores its experts fused
(gate_up_proj [experts, hidden, 2 * inter] with gate and up interleaved, down_proj [experts,
inter, hidden]); gpt_oss.py presents them per expert. Its layers alternate a 128-token window and
full attention. Qwen3-VL-MoE stores its experts fused too, gate and up as halves.

Hybrid families (Qwen3-Next, Qwen3.5) make most layers Gated DeltaNet linear attention
(linear_attention.py): a fixed-size state per request instead of KV. `layer_types` says which
layer is which; their full-attention layers gate their output and rotate part of each head.

Adding a family is a `Family` entry and, when its config spells things its own way, a few
lines in `ModelConfig.from_hf` (see Gemma 3's layer types and rope parameters).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.json_types import JSONObject
from unison.model.layers.rope import Rope


@dataclass(frozen=True)
class MoeNames:
    """Where a sparse MLP lives in a family's checkpoint, under model.layers.N."""

    router: str  # the router's linear: [experts, hidden]
    experts: str  # expert e's projections are under f"{experts}.{e}."
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str | None = None  # a shared expert's gated MLP (gate_proj, up_proj, down_proj) under it
    shared_gate: str | None = None  # its sigmoid gate's linear: [1, hidden]

    def expert(self, layer: int, e: int, proj: str) -> str:
        """The checkpoint name of expert e's `proj` (gate, up or down) weight in `layer`."""
        return f"model.layers.{layer}.{self.experts}.{e}.{getattr(self, proj)}.weight"

    def router_weight(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.router}.weight"

    def router_bias(self, layer: int) -> str:  # (gpt-oss's: a bias on the router, and on each expert)
        return f"model.layers.{layer}.{self.router}.bias"

    def expert_bias(self, layer: int, e: int, proj: str) -> str:
        return self.expert(layer, e, proj).removesuffix(".weight") + ".bias"


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
    # Gated DeltaNet layers where layer_types says "linear_attention". Their projections come
    # apart (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) or fused and interleaved per key
    # head (Qwen3-Next: in_proj_qkvz, in_proj_ba; llama.cpp splits the first): the loader reads
    # whichever the checkpoint has.
    linear_attention: bool = False
    attn_output_gate: bool = False  # q_proj also gives a per-head gate: attention * sigmoid(gate)
    text_prefix: str = "model."  # where the text model's tensors are (a multimodal checkpoint's)
    attention_sinks: bool = False  # self_attn.sinks: a learned logit per head in the softmax (gpt-oss)
    # experts stored fused (gpt_oss.py), gate and up "interleaved" (gpt-oss) or as "halves" (Qwen3-VL-MoE)
    fused_experts: str | None = None


LLAMA = Family("llama", "LlamaForCausalLM", "llama")
GEMMA3 = Family("gemma3", "Gemma3ForCausalLM", "gemma3", activation="gelu_tanh", norm_plus_one=True,
                embed_scale=True, qk_norm="head",
                norms={"input": "input_layernorm", "post_attention": "post_attention_layernorm",
                       "pre_mlp": "pre_feedforward_layernorm", "post_mlp": "post_feedforward_layernorm"})
QWEN_SHARED = MoeNames("mlp.gate", "mlp.experts", shared="mlp.shared_expert",
                       shared_gate="mlp.shared_expert_gate")
# Qwen3-Next and Qwen3.5: (1 + w) norms (but linear_attn.norm's), qk-norm, a gated attention output.
_HYBRID: dict[str, Any] = {"linear_attention": True, "norm_plus_one": True, "qk_norm": "head",
                          "attn_output_gate": True}
FAMILIES = [
    LLAMA,
    Family("mistral", "MistralForCausalLM", None),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2"),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm="head"),
    GEMMA3,
    # Gemma 3 4B and up: the text model beside a vision tower (vision/encoder.py), under published names.
    dataclasses.replace(GEMMA3, hf_architecture="Gemma3ForConditionalGeneration", gguf_architecture=None,
                        text_prefix="language_model.model."),
    Family("olmo2", "Olmo2ForCausalLM", None, qk_norm="full",
           norms={"post_attention": "post_attention_layernorm", "post_mlp": "post_feedforward_layernorm"}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", qk_norm="head",
           moe=MoeNames("mlp.gate", "mlp.experts")),
    # GGUF writes Mixtral as "llama" with expert tensors (gguf.py tells them apart).
    Family("mixtral", "MixtralForCausalLM", None,
           moe=MoeNames("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")),
    Family("olmoe", "OlmoeForCausalLM", "olmoe", qk_norm="full", moe=MoeNames("mlp.gate", "mlp.experts")),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe", moe=QWEN_SHARED),
    Family("qwen3_next", "Qwen3NextForCausalLM", "qwen3next", **_HYBRID, moe=QWEN_SHARED),
    Family("qwen3_5", "Qwen3_5ForCausalLM", "qwen35", **_HYBRID),
    Family("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "qwen35moe", **_HYBRID, moe=QWEN_SHARED),
    # Qwen3-VL (dense): Qwen3 beside a vision tower (vision/qwen_vision.py), M-RoPE and DeepStack.
    Family("qwen3_vl", "Qwen3VLForConditionalGeneration", None, qk_norm="head",
           text_prefix="model.language_model."),
    Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", None, qk_norm="head",
           text_prefix="model.language_model.", moe=MoeNames("mlp.gate", "mlp.experts"),
           fused_experts="halves"),
    # Their text models alone, as llama.cpp writes them (qwen3vl, qwen3vlmoe; the tower in an
    # mmproj file): the experts stacked per projection, as Qwen3-MoE's
    Family("qwen3_vl_text", "Qwen3VLTextModel", "qwen3vl", qk_norm="head"),
    Family("qwen3_vl_moe_text", "Qwen3VLMoeTextModel", "qwen3vlmoe", qk_norm="head",
           moe=MoeNames("mlp.gate", "mlp.experts")),
    # The published Qwen3.5 checkpoints: the text model beside a vision tower (vision/qwen_vision.py).
    Family("qwen3_5_vl", "Qwen3_5ForConditionalGeneration", None, **_HYBRID,
           text_prefix="model.language_model."),
    Family("qwen3_5_moe_vl", "Qwen3_5MoeForConditionalGeneration", None, **_HYBRID,
           moe=QWEN_SHARED, text_prefix="model.language_model."),
    Family("gpt_oss", "GptOssForCausalLM", "gpt-oss", activation="swiglu_oai", attention_sinks=True,
           fused_experts="interleaved", moe=MoeNames("mlp.router", "mlp.experts")),
]
BY_ARCHITECTURE = {f.hf_architecture: f for f in FAMILIES}
BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}
SUPPORTED = sorted(BY_ARCHITECTURE)
# M-RoPE's (time, rows, columns) sections where a config gives none: transformers' defaults
MROPE_DEFAULTS = {**dict.fromkeys(("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"), (11, 11, 10)),
                  **dict.fromkeys(("qwen3_vl", "qwen3_vl_moe", "qwen3_vl_text", "qwen3_vl_moe_text"),
                                  (24, 20, 20))}


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
    experts when `norm_topk_prob`), plus a shared expert of `shared_intermediate_size` (0: none)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, family: Family, hf: JSONObject) -> MoeConfig:
        arch = family.hf_architecture
        assert family.moe is not None  # called for MoE families only
        # Variants with parts this MLP lacks are refused by name rather than run wrongly.
        refused = ["n_shared_experts", "n_group", "topk_group"]
        if family.moe.shared is None:
            refused.insert(0, "shared_expert_intermediate_size")
        for key in refused:
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
        shared = 0
        if family.moe.shared is not None:
            key = "shared_expert_intermediate_size"
            shared = _positive(arch, key, hf.get(key))
        if experts > 1024:  # the kernel's bound (csrc/moe.c); no released model comes near it
            raise ValueError(f"{arch}: num_experts ({experts}) is over 1024, which is not supported")
        if top_k > experts:
            raise ValueError(f"{arch}: num_experts_per_tok ({top_k}) exceeds num_experts ({experts})")
        if size % 8 or hf["hidden_size"] % 8:
            raise ValueError(f"{arch}: the experts' sizes (moe_intermediate_size {size}, hidden_size "
                             f"{hf['hidden_size']}) must be multiples of 8")
        # Mixtral and Qwen3.5 always renormalize the top-k weights (gpt-oss's softmax over the k
        # is the same); the others say so in the config (Qwen3-Next's default: yes).
        always = family.name in ("mixtral", "gpt_oss", "qwen3_vl_moe") or family.name.startswith("qwen3_5")
        norm = True if always else bool(hf.get("norm_topk_prob", family.linear_attention))
        return cls(experts, top_k, size, norm, shared)


@dataclass(frozen=True, slots=True)
class DeltaNetConfig:
    """A Gated DeltaNet layer's shape (linear_attention.py). q and k have `num_k_heads` heads of
    `head_k_dim`, v and the output `num_v_heads` of `head_v_dim`; each value head reads key head
    h // (num_v_heads / num_k_heads), or h % num_k_heads where the value heads are `tiled` (a
    Qwen3.5 GGUF: llama.cpp's converter reorders them so, everywhere they appear). The causal
    convolution spans `conv_kernel` tokens."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_floats(self) -> int:
        """One request's state in one layer: the convolution's last inputs and the delta-rule matrix."""
        return (self.conv_kernel - 1) * self.conv_dim + self.num_v_heads * self.head_k_dim * self.head_v_dim

    @classmethod
    def from_hf(cls, arch: str, hf: JSONObject) -> DeltaNetConfig:
        hk, hv, dk, dv, kernel = (_positive(arch, key, hf.get(key)) for key in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim"))
        cfg = cls(hk, hv, dk, dv, kernel, tiled=bool(hf.get("linear_value_heads_tiled", False)))
        if cfg.num_v_heads % cfg.num_k_heads:
            raise ValueError(f"{arch}: linear_num_value_heads ({cfg.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({cfg.num_k_heads})")
        return cfg


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
    # "full_attention" or "linear_attention" per layer (a hybrid family's; others: all full)
    layer_types: list[str] = field(default_factory=list)
    linear: DeltaNetConfig | None = None  # the linear-attention layers' shape
    rotary_dim: int = 0  # dims of each head that are rotated (the first ones); 0: all of head_dim
    quant_method: str | None = None  # quantization_config's: "mxfp4" (gpt-oss's experts as published)

    @property
    def architecture(self) -> str:
        return self.family.hf_architecture

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @property
    def attention_layers(self) -> list[int]:
        """The layers with full (softmax) attention over the KV cache, in order."""
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        """The Gated DeltaNet layers, whose per-request state lives in the state pool."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def kv_windows(self) -> list[int | None]:
        """The window of each layer that keeps KV, by its index in the KV cache."""
        return [self.layer_window[i] for i in self.attention_layers]

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
        quant_method = (hf.get("quantization_config") or {}).get("quant_method")
        if quant_method not in (None, "mxfp4"):  # others store weights under names it does not read
            raise ValueError(f"{family.hf_architecture} with quantization_config.quant_method "
                             f"{quant_method!r} is not supported (mxfp4 is; or a GGUF of the model)")
        if family.text_prefix != "model.":  # a multimodal checkpoint: its text model's config
            hf = _text_config(family, hf)
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "clip_qkv"):
            if hf.get(key) is not None:
                raise ValueError(f"{family.hf_architecture} with {key} is not supported")
        for key, value in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):  # the kernels' constants
            if family.activation == "swiglu_oai" and hf.get(key, value) != value:
                raise ValueError(f"{family.hf_architecture} with {key}={hf[key]!r} is not supported "
                                 f"(the kernels run {value})")
        heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        positions = hf.get("max_position_embeddings", 4096)
        ropes, layer_rope, windows = _attention_layout(family, hf, head_dim, layers, positions)
        scalar = hf.get("query_pre_attn_scalar") if family.name == "gemma3" else None
        layer_types = _layer_types(family, hf, layers)
        linear = DeltaNetConfig.from_hf(family.hf_architecture, hf) if family.linear_attention else None
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
            layer_types=layer_types,
            linear=linear,
            rotary_dim=ropes[0].head_dim if ropes[0].head_dim != head_dim else 0,
            quant_method=quant_method,
        )

    def __post_init__(self) -> None:
        self.eos_token_ids = list(dict.fromkeys(self.eos_token_ids))
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers


def _text_config(family: Family, hf: JSONObject) -> JSONObject:
    """A multimodal checkpoint's text model config, under its own architecture name (its vision
    tower's is read by vision/encoder.py)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{family.hf_architecture} config has no text_config")
    return {**text, "architectures": [family.hf_architecture],
            "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def _layer_types(family: Family, hf: JSONObject, layers: int) -> list[str]:
    """Each layer's kind: a hybrid family's "linear_attention" and "full_attention" (every
    `full_attention_interval`-th layer when the config lists none), else all full."""
    if not family.linear_attention:
        return ["full_attention"] * layers
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full_attention", "linear_attention"}:
        raise ValueError(f"{family.hf_architecture}: layer_types must list 'full_attention' or "
                         f"'linear_attention' for each of the {layers} layers, got {types!r}")
    return list(types)


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
    if family.name == "gpt_oss":  # sliding and full layers alternate, one rope for both
        types = hf.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        windows = [hf.get("sliding_window") if t == "sliding_attention" else None for t in types]
        params = {"rope_theta": hf.get("rope_theta", 150000.0), **(hf.get("rope_scaling") or {}),
                  **(hf.get("rope_parameters") or {})}
        return [Rope.from_params(head_dim, params, positions)], [0] * layers, windows
    # transformers 5 keeps theta and scaling under rope_parameters; older configs at top level
    params = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {}),
              **(hf.get("rope_parameters") or {})}
    # Qwen3-Next and Qwen3.5 rotate a part of each head; Qwen3.5 and Qwen3-VL keep M-RoPE's
    # sections for images' rows (a text token's sections all carry one position: plain rotary).
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    params.setdefault("mrope_section", MROPE_DEFAULTS.get(family.name))  # (transformers' where unsaid)
    rope = Rope.from_params(int(head_dim * partial), params, positions)
    if factors is not None:
        rope = dataclasses.replace(rope, factors=factors)
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
