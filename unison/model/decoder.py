"""The decoder, plain PyTorch plus the C kernels: every family of families.py with one forward.

Llama 2/3, SmolLM, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (qk-norm), Gemma 3
(sandwich norms, GELU, windowed and global layers with their own rope), OLMo 2 (post-norms),
the mixtures of experts Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE (a sparse MLP, a shared expert:
moe.py), and the hybrids Qwen3-Next and Qwen3.5, whose Gated DeltaNet layers keep a state per
request (linear_attention.py) and whose attention layers gate their output.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from unison.model.families import ModelConfig
from unison.model.kernels import cpu_kernels
from unison.model.kernels.torch_ops import TorchOps
from unison.model.layers.linear_attention import DeltaNet, DeltaStates, projection_order
from unison.model.layers.linears import Embedding, Linear, QuantLinear
from unison.model.layers.lora import LoraStep
from unison.model.layers.moe import PROJECTIONS, FloatMoe, MoeBiases, QuantMoe, SharedExpert
from unison.model.weights import quant
from unison.model.weights.gpt_oss import FusedExperts
from unison.model.weights.quant import QuantWeight
from unison.model.weights.sources import DictWeights, RenamedWeights, WeightSource, linear_bits

# attention(layer, q [N, heads, head_dim], k, v [N, kv_heads, head_dim]) -> [N, heads * head_dim]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _nbytes(linear: Linear | QuantLinear | FloatMoe | QuantMoe) -> int:
    if isinstance(linear, FloatMoe | QuantMoe):
        return linear.nbytes
    if isinstance(linear, QuantLinear):
        return sum(p.nbytes for p in linear.parts)
    w = linear.held
    return w.numel() * w.element_size() + (0 if linear.bias is None else linear.bias.numel() * 4)


def _kind(linear: Linear | QuantLinear | FloatMoe | QuantMoe) -> str:
    if isinstance(linear, QuantLinear | FloatMoe | QuantMoe):
        return linear.kind
    return str(linear.held.dtype).removeprefix("torch.")


@dataclass(slots=True)
class Layer:
    # q, k, v projections fused: [(heads + 2 * kv_heads) * head_dim, hidden] (q doubled where the
    # family gates the output: each head's q, then its gate); None in a linear-attention layer
    qkv: Linear | QuantLinear | None
    o_proj: Linear | QuantLinear | None
    gate_up: Linear | QuantLinear | None  # gate and up projections fused: [2 * intermediate, hidden]
    down: Linear | QuantLinear | None  # (None where a mixture of experts is the MLP)
    # The norms a family has (families.Family.norms), None where it has none.
    input_norm: torch.Tensor | None
    post_attention_norm: torch.Tensor | None
    pre_mlp_norm: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    rope: int  # index into the model's ropes
    moe: FloatMoe | QuantMoe | None = None  # the MLP of a mixture-of-experts family
    shared: SharedExpert | None = None  # ... and its shared expert, where it has one
    delta: DeltaNet | None = None  # a Gated DeltaNet layer's mixer, in place of attention
    sinks: torch.Tensor | None = None  # [heads] float32: learned logits in the softmax (gpt-oss)

    @property
    def linears(self) -> dict[str, Linear | QuantLinear | FloatMoe | QuantMoe]:
        """The layer's weight-holding parts by name, in forward order."""
        mixer: dict[str, Linear | QuantLinear | FloatMoe | QuantMoe]
        if self.delta is not None:
            mixer = {"in_proj": self.delta.in_proj, "out_proj": self.delta.out_proj}
        else:
            assert self.qkv is not None and self.o_proj is not None  # an attention layer has both
            mixer = {"qkv": self.qkv, "o_proj": self.o_proj}
        mlp: dict[str, Linear | QuantLinear | FloatMoe | QuantMoe]
        if self.moe is not None:
            mlp = {"experts": self.moe}
            if self.shared is not None:
                mlp |= {"shared_gate_up": self.shared.gate_up, "shared_down": self.shared.down}
        else:
            assert self.gate_up is not None and self.down is not None  # a dense MLP has both
            mlp = {"gate_up": self.gate_up, "down": self.down}
        return {**mixer, **mlp}

    @property
    def small_tensors(self) -> list[torch.Tensor]:
        """The float tensors beside the linears: norms, and a linear layer's own."""
        own = [self.input_norm, self.post_attention_norm, self.pre_mlp_norm, self.post_mlp_norm,
               self.q_norm, self.k_norm, None if self.shared is None else self.shared.gate, self.sinks]
        if self.delta is not None:
            d = self.delta
            own += [d.conv_weight, d.dt_bias, d.neg_a, d.norm]
        return [t for t in own if t is not None]


class DecoderModel:
    """Weights as plain tensors and a forward over a flat batch of tokens; attention is supplied.

    `quantization` (none, int8 or int4, resolved by weights.resolve_quantization) picks the
    linears' kernels: oneDNN fp32, or the quantized C kernel on the source's blocks."""

    def __init__(self, cfg: ModelConfig, weights: WeightSource, device: torch.device,
                 dtype: torch.dtype, quantization: str = "none", from_gguf: bool = False,
                 linear_dtype: torch.dtype | None = None):
        """`linear_dtype`: what float linears run as, when not `dtype` (bf16 linears on CPU)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        # Kept (a checkpoint is memory-mapped, not copied): replacing some tensors rebuilds from it.
        self.source, self.from_gguf = weights, from_gguf
        if cfg.family.text_prefix != "model.":  # a multimodal checkpoint's text model
            weights = RenamedWeights(weights, "model.", cfg.family.text_prefix)
        if cfg.family.fused_experts:  # gpt-oss's and Qwen3-VL-MoE's experts, read one by one
            weights = FusedExperts(weights, cfg.family.fused_experts, cfg.hidden_size)
        # The C kernels where they apply (CPU, float32); torch ops elsewhere.
        kernels = cpu_kernels.load() if device.type == "cpu" and dtype == torch.float32 else None
        self.ops: TorchOps | cpu_kernels.CpuKernels = kernels or TorchOps()
        get = _WeightGetter(weights, device, dtype, quantization, from_gguf, kernels,
                            cfg.family.norm_plus_one, linear_dtype or dtype)
        self.embed = get.embedding("model.embed_tokens.weight")
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.family.embed_scale else None
        self.norm = get.norm("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = get.head(self.embed) if tied else get.linear(["lm_head.weight"], head=True)
        # A layer's index in the KV cache (attention layers) or in the state pool (linear ones)
        self.kv_index = {layer: i for i, layer in enumerate(cfg.attention_layers)}
        self.linear_index = {layer: i for i, layer in enumerate(cfg.linear_layers)}
        self.layers = [self._layer(get, i) for i in _loading(cfg.num_hidden_layers)]
        self.weight_shapes = get.shapes  # what replacement weights must match (a reload)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim

    def _layer(self, get: _WeightGetter, i: int) -> Layer:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        norms = {role: get.norm(p + name + ".weight") for role, name in self.cfg.family.norms.items()}
        linear = i in self.linear_index
        optional = {x: get.norm(a + x + ".weight") if not linear and get.has(a + x + ".weight") else None
                    for x in ("q_norm", "k_norm")}
        sparse = self.cfg.moe is not None
        return Layer(
            qkv=None if linear else get.linear(
                [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                bias if get.has(bias[0]) else None),
            o_proj=None if linear else get.linear([a + "o_proj.weight"], [a + "o_proj.bias"]
                                                  if get.has(a + "o_proj.bias") else None),
            sinks=get.vector(a + "sinks", self.cfg.num_attention_heads)
            if self.cfg.family.attention_sinks and not linear else None,
            delta=load_delta_net(get, self.cfg, p + "linear_attn.") if linear else None,
            gate_up=None if sparse else get.linear([m + "gate_proj.weight", m + "up_proj.weight"]),
            down=None if sparse else get.linear([m + "down_proj.weight"]),
            moe=load_moe(get, self.cfg, i) if sparse else None,
            shared=load_shared_expert(get, self.cfg, i) if sparse else None,
            input_norm=norms.get("input"), post_attention_norm=norms.get("post_attention"),
            pre_mlp_norm=norms.get("pre_mlp"), post_mlp_norm=norms.get("post_mlp"),
            rope=self.cfg.layer_rope[i], **optional,
        )

    def weights_bytes(self) -> int:
        """Bytes of the weights as executed (packed, quantized or not), norms included."""
        tensors = [self.norm] + [t for layer in self.layers for t in layer.small_tensors]
        total = sum(t.numel() * t.element_size() for t in tensors) + self.embed.nbytes
        linears = [x for layer in self.layers for x in layer.linears.values()]
        head = 0 if self._head_is_embed() else _nbytes(self.lm_head)
        return total + sum(_nbytes(x) for x in linears) + head

    def _head_is_embed(self) -> bool:
        """Whether the LM head runs on the embedding's own quantized table (one copy of it)."""
        return isinstance(self.lm_head, QuantLinear) and self.lm_head.parts[0] is self.embed.quant

    def step_bytes(self) -> int:
        """Bytes one decode step of one sequence moves (the bound on its speed is the memory's
        bandwidth over this): every linear and norm, each mixture's router and top_k experts, one
        row of the embedding (all of it where it is also the LM head), and a hybrid's
        linear-attention state, read and written (4.4 MB a linear layer at Qwen3.5-35B-A3B's shape,
        about a tenth of what a layer's weights take at one token)."""
        total = self.weights_bytes()
        moes = [x for layer in self.layers for x in layer.linears.values()
                if isinstance(x, FloatMoe | QuantMoe)]
        total -= sum(m.nbytes - m.step_nbytes for m in moes)
        row = self.embed.nbytes // self.cfg.vocab_size
        linear = self.cfg.linear
        state = 0 if linear is None else 2 * DeltaStates.slot_bytes(linear, len(self.cfg.linear_layers))
        return state + (total + row if self._head_is_embed() else total - self.embed.nbytes + row)

    def linear_kinds(self) -> dict[str, str]:
        """What each linear (and the embedding) runs as: float32, int8, int4 or a mix."""
        kinds = {"embed_tokens": self.embed.kind, "lm_head": _kind(self.lm_head)}
        for i, layer in enumerate(self.layers):
            for name, linear in layer.linears.items():
                kinds[f"layers.{i}.{name}"] = _kind(linear)
        return kinds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                logits_rows: torch.Tensor | None, lora: LoraStep | None = None,
                head: bool = True, states: DeltaStates | None = None,
                images: cpu_kernels.ImageRows | None = None) -> torch.Tensor:
        """Float32 logits [len(logits_rows), vocab] for the flat batch `input_ids` (head=False: the
        final norm's hidden states instead, what a pooled decoder embeds); `lora`: the rows'
        adapters (lora.py), whose updates follow each linear, as in csrc/decoder.c; `states`: the
        linear-attention layers' per-request states, opened for this step (a hybrid's); `images`:
        rows whose embeddings are an image's (vision/encoder.py), put in place of their tokens',
        and their DeepStack features added after the first layers. `positions`: each row's rotary
        position, [N], or M-RoPE's [3, N]."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        rope = [r.cos_sin(positions, self.dtype) for r in cfg.ropes]  # once per step, not per layer
        h = self.embed(input_ids)
        if self.embed_scale is not None:  # as transformers: the scale rounded to the model's dtype
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        if images is not None:  # after the scale: an image's embeddings are not scaled (transformers)
            h.index_copy_(0, images.rows, images.values.to(h.dtype))
        nexts = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        x = _add_norm(ops, h, None, self.layers[0].input_norm, eps)
        hook = lora.apply if lora is not None else _no_lora
        for i, layer in enumerate(self.layers):
            if layer.delta is not None:
                assert states is not None and cfg.linear is not None  # a hybrid's step opens them
                delta = layer.delta.forward(x, self.linear_index[i], cfg.linear, states, ops, eps)
            else:
                assert layer.o_proj is not None  # an attention layer
                q, k, v, gate = self._qkv(layer, x, *rope[layer.rope], hook, 4 * i)
                attn = attention(self.kv_index[i], q, k, v)
                if gate is not None:
                    ops.mul_act_(attn, gate, "sigmoid")
                delta = layer.o_proj(attn)
                hook(4 * i + 1, attn, delta)
            if layer.post_attention_norm is not None:
                delta = ops.add_rms_norm(delta, None, layer.post_attention_norm, eps)
            x = _add_norm(ops, h, delta, layer.pre_mlp_norm, eps)
            if layer.moe is not None:  # (LoRA adapters never target the experts: refused at load)
                delta = layer.moe(x)
                if layer.shared is not None:
                    delta.add_(layer.shared(x, ops))
            else:
                assert layer.gate_up is not None and layer.down is not None  # a dense MLP has both
                gate_up = layer.gate_up(x)
                hook(4 * i + 2, x, gate_up)
                act = ops.act_mul(gate_up, cfg.family.activation)
                delta = layer.down(act)
                hook(4 * i + 3, act, delta)
            if layer.post_mlp_norm is not None:
                delta = ops.add_rms_norm(delta, None, layer.post_mlp_norm, eps)
            if images is not None and i < len(images.deepstack):  # Qwen3-VL: after the layer's residual
                h.add_(delta).index_add_(0, images.rows, images.deepstack[i].to(h.dtype))
                x = _add_norm(ops, h, None, nexts[i], eps)
            else:
                x = _add_norm(ops, h, delta, nexts[i], eps)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)  # the LM head is costly: only rows that need logits
        return self.lm_head(x).float() if head else x.float()

    def replay_states(self, states: DeltaStates, kept: dict[int, int]) -> None:
        """After a verified draft: the drafted slots' linear-attention states as if only their first
        `kept[slot]` rows had run (the real token and the draft tokens kept), from the state before
        the step and the rows' recorded inputs, one token at a time as the step ran them."""
        cfg, step = self.cfg, states.rewind(kept)
        if step is not None:
            assert cfg.linear is not None  # only a hybrid has states
            for i, layer in enumerate(self.layers):
                if layer.delta is not None:
                    index = self.linear_index[i]
                    x, g, beta = states.replay_inputs(index, step)
                    layer.delta.recurrence(x, g, beta, *states.layer(index), step, cfg.linear, self.ops)
        states.forget_drafts()

    def _qkv(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             lora: Callable[[int, torch.Tensor, torch.Tensor], None], linear: int):
        """q [N, heads, d], k and v [N, kv_heads, d], and the output gate [N, heads * d] where the
        family has one (else None): projected (`lora` adds the adapters' updates to linear number
        `linear`), normed where the family norms them, rotated."""
        cfg, qs, kvs, eps = self.cfg, self.q_size, self.kv_size, self.cfg.rms_norm_eps
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        assert layer.qkv is not None  # an attention layer
        qkv = layer.qkv(x)
        lora(linear, x, qkv)
        n, gate = qkv.shape[0], None
        if cfg.family.attn_output_gate:  # q_proj gives each head's q, then its gate
            qg = qkv[:, : 2 * qs].view(n, heads, 2, d)
            q, gate = qg[:, :, 0].reshape(n, qs), qg[:, :, 1].reshape(n, qs)
            k, v = qkv[:, 2 * qs: 2 * qs + kvs], qkv[:, 2 * qs + kvs:]
        else:
            q, k, v = qkv[:, :qs], qkv[:, qs: qs + kvs], qkv[:, qs + kvs:]
        if layer.q_norm is not None:  # before the rotation: per head (Qwen3, Gemma 3), or over
            per_head = cfg.family.qk_norm == "head"  # the whole q and k projections (OLMo 2)
            assert layer.k_norm is not None  # q and k are normed together
            self.ops.norm_groups_(q, heads if per_head else 1, d if per_head else qs, layer.q_norm, eps)
            self.ops.norm_groups_(k, kv_heads if per_head else 1, d if per_head else kvs, layer.k_norm, eps)
        if gate is None:
            self.ops.rope_(qkv[:, : qs + kvs], heads + kv_heads, d, cos, sin)  # q and k heads side by side
        else:
            self.ops.rope_(q, heads, d, cos, sin)
            self.ops.rope_(k, kv_heads, d, cos, sin)
        return q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d), gate


def _no_lora(linear: int, x: torch.Tensor, y: torch.Tensor) -> None:
    pass


def _add_norm(ops: TorchOps | cpu_kernels.CpuKernels, h: torch.Tensor, delta: torch.Tensor | None,
              weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """h += delta, then the next norm's input: norm(h), or h itself where no norm comes next."""
    if weight is not None:
        return ops.add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h.add_(delta)
    return h.clone()  # the caller's next residual add must not change what the layer reads


class _WeightGetter:
    """Fetches checkpoint tensors by name: norms as float tensors on the model's device and dtype,
    linears as packed oneDNN weights or quantized blocks, per the model's quantization."""

    def __init__(self, weights: WeightSource, device: torch.device, dtype: torch.dtype,
                 quantization: str, from_gguf: bool, kernels: cpu_kernels.CpuKernels | None,
                 norm_plus_one: bool, linear_dtype: torch.dtype):
        self.weights, self.device, self.dtype, self.linear_dtype = weights, device, dtype, linear_dtype
        self.quantization, self.from_gguf, self.kernels = quantization, from_gguf, kernels
        self.norm_plus_one = norm_plus_one
        self.shapes: dict[str, tuple[int, ...]] = {}  # every tensor fetched, by name
        if quantization != "none":  # a GGUF type the kernels cannot run: refused before any is read
            getattr(weights, "check_runnable", lambda: None)()

    def has(self, name: str) -> bool:
        return name in self.weights

    def label(self, name: str) -> str:
        """`name` for an error: with the file's own name for it (a GGUF's) where that differs."""
        own = getattr(self.weights, "file_name", lambda _: None)(name)
        return repr(name) if own is None or own == name else f"{own!r} ({name})"

    @property
    def quant_kernels(self) -> cpu_kernels.CpuKernels:
        """The C kernels, which quantized weights need (resolve_quantization allows them on CPU only)."""
        assert self.kernels is not None
        return self.kernels

    def _fetched(self, name: str) -> str:
        self.shapes[name] = tuple(self.weights.shape(name))
        return name

    def __call__(self, name: str) -> torch.Tensor:
        return self.weights.float(self._fetched(name)).to(device=self.device, dtype=self.dtype).contiguous()

    def vector(self, name: str, size: int) -> torch.Tensor:
        """A float32 vector the kernels read `size` values of (sinks, biases): its shape checked, so
        that a wrong checkpoint is refused naming the tensor, never read past its end."""
        if not self.has(name):
            raise ValueError(f"checkpoint is missing weight {self.label(name)}")
        if tuple(self.weights.shape(name)) != (size,):
            raise ValueError(f"weight {self.label(name)} is {list(self.weights.shape(name))}; this config "
                             f"needs [{size}]")
        return self.weights.float(self._fetched(name)).to(self.device, torch.float32).contiguous()

    def norm(self, name: str, plus_one: bool | None = None) -> torch.Tensor:
        """A norm's scale. Gemma, Qwen3-Next and Qwen3.5 store w for a (1 + w) scale: added here,
        in float32 as transformers does, so the forward always multiplies by the weight.
        `plus_one`: whether this norm is stored so, when it differs from the family's others."""
        w = self.weights.float(self._fetched(name)).float()
        one = self.norm_plus_one if plus_one is None else plus_one
        return (1.0 + w if one else w).to(device=self.device, dtype=self.dtype).contiguous()

    def _bits(self, name: str, head: bool = False) -> int | None:
        return linear_bits(self.quantization, self.weights.source_type(name), head=head,
                           from_gguf=self.from_gguf)

    def bits_of(self, names: list[str]) -> int | None:
        """The bits the weights `names` run at together (a mixture's experts of one projection):
        ValueError where they differ, as no GGUF writes them so."""
        bits = {self._bits(self._fetched(n)) for n in names}
        if len(bits) > 1:
            raise ValueError(f"{names[0]} and the tensors beside it would run at different widths {bits}")
        return bits.pop()

    def linear(self, names: list[str], bias: list[str] | None = None, head: bool = False
               ) -> Linear | QuantLinear:
        bias_t = torch.cat([self(b) for b in bias]) if bias else None
        bits = [self._bits(self._fetched(n), head) for n in names]
        if bits[0] is None:
            w = torch.cat([self.weights.float(n) for n in names])
            return Linear(w.to(device=self.device, dtype=self.linear_dtype), bias_t)
        parts: list[QuantWeight] = []
        for name, b in zip(names, bits):
            assert b is not None  # the quantization mode quantizes every linear or none
            q = self.weights.quantized(name, b)
            if parts and parts[-1].format == q.format and parts[-1].n % quant.TILE == 0:
                parts[-1] = quant.concat([parts[-1], q])  # one kernel call for same-kind parts
            else:
                parts.append(q)
        return QuantLinear(parts, bias_t, self.quant_kernels)

    def embedding(self, name: str) -> Embedding:
        bits = self._bits(self._fetched(name), head=True)
        if bits is None:
            return Embedding(self(name))
        return Embedding(None, self.weights.quantized(name, bits), self.quant_kernels)

    def head(self, embed: Embedding) -> Linear | QuantLinear:
        """The LM head of a tied model: the embedding's own tensor, float or quantized."""
        if embed.quant is None:
            return Linear(embed.float_table.to(self.linear_dtype))
        return QuantLinear([embed.quant], None, self.quant_kernels)


def load_moe(get: _WeightGetter, cfg: ModelConfig, layer: int) -> FloatMoe | QuantMoe:
    """Layer `layer`'s router and experts, as floats or in quantized blocks (per the model's
    quantization, as its other linears)."""
    names, moe = cfg.family.moe, cfg.moe
    assert names is not None and moe is not None
    router = get(names.router_weight(layer))
    per_proj = {p: [names.expert(layer, e, p) for e in range(moe.num_experts)] for p in PROJECTIONS}
    biases = None
    if get.has(names.router_bias(layer)):  # gpt-oss's: the router's and every expert's
        sizes = {"gate": moe.intermediate_size, "up": moe.intermediate_size, "down": cfg.hidden_size}
        experts = range(moe.num_experts)
        biases = MoeBiases(get.vector(names.router_bias(layer), moe.num_experts), *(
            torch.stack([get.vector(names.expert_bias(layer, e, p), sizes[p]) for e in experts])
            for p in PROJECTIONS))
    bits = {p: get.bits_of(per_proj[p]) for p in PROJECTIONS}
    if any(b is None for b in bits.values()):
        gate, up, down = (torch.stack([get(n) for n in per_proj[p]]) for p in PROJECTIONS)
        return FloatMoe(moe, cfg.family.activation, router, gate, up, down, biases)
    widths = {p: b for p, b in bits.items() if b is not None}  # (every one: checked above)
    # Experts convert one by one in numpy, which lets go of the GIL: a thread per core loads a
    # 128-expert layer about twice as fast on two cores.
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        packed = {p: quant.stack(list(pool.map(partial(get.weights.quantized, bits=widths[p]), per_proj[p])))
                  for p in PROJECTIONS}
    return QuantMoe(moe, cfg.family.activation, router, packed["gate"], packed["up"], packed["down"],
                    get.quant_kernels, biases)


def load_shared_expert(get: _WeightGetter, cfg: ModelConfig, layer: int) -> SharedExpert | None:
    """Layer `layer`'s shared expert, where the family has one."""
    names, moe = cfg.family.moe, cfg.moe
    if names is None or names.shared is None or names.shared_gate is None or moe is None:
        return None
    p = f"model.layers.{layer}.{names.shared}."
    gate_name = f"model.layers.{layer}.{names.shared_gate}.weight"
    expected = {p + "gate_proj.weight": (moe.shared_intermediate_size, cfg.hidden_size),
                p + "up_proj.weight": (moe.shared_intermediate_size, cfg.hidden_size),
                p + "down_proj.weight": (cfg.hidden_size, moe.shared_intermediate_size)}
    for name, shape in {**expected, gate_name: (1, cfg.hidden_size)}.items():
        if not get.has(name):
            raise ValueError(f"checkpoint is missing weight {get.label(name)} (a shared expert)")
        got = tuple(get.weights.shape(name))
        if got != shape and not (name == gate_name and got == (cfg.hidden_size,)):
            raise ValueError(f"weight {get.label(name)} is {list(got)}; this config needs {list(shape)}")
    gate = get(gate_name).float().reshape(-1)
    return SharedExpert(get.linear([p + "gate_proj.weight", p + "up_proj.weight"]),
                        get.linear([p + "down_proj.weight"]), gate.contiguous(), cfg.family.activation)


def load_delta_net(get: _WeightGetter, cfg: ModelConfig, p: str) -> DeltaNet:
    """A Gated DeltaNet layer's weights under `p` (model.layers.N.linear_attn.), in whichever
    layout the checkpoint has them (Qwen3.5's, Qwen3-Next's fused one, llama.cpp's), each checked
    against the config's shape so that a wrong checkpoint is refused naming the tensor."""
    lin = cfg.linear
    assert lin is not None  # a hybrid family's config has it
    hv, hidden = lin.num_v_heads, cfg.hidden_size
    fused_qkvz, fused_ba = get.has(p + "in_proj_qkvz.weight"), get.has(p + "in_proj_ba.weight")
    qkvz = ({"in_proj_qkvz": (lin.conv_dim + lin.value_dim, hidden)} if fused_qkvz else
            {"in_proj_qkv": (lin.conv_dim, hidden), "in_proj_z": (lin.value_dim, hidden)})
    ba = ({"in_proj_ba": (2 * hv, hidden)} if fused_ba else
          {"in_proj_b": (hv, hidden), "in_proj_a": (hv, hidden)})
    # A GGUF holds -exp(A_log) (llama.cpp's ssm_a), a checkpoint A_log itself
    decay = "neg_A" if get.has(p + "neg_A") else "A_log"
    expected = {**{f"{n}.weight": shape for n, shape in (qkvz | ba).items()},
                "out_proj.weight": (hidden, lin.value_dim),
                "conv1d.weight": (lin.conv_dim, 1, lin.conv_kernel),
                "dt_bias": (hv,), decay: (hv,), "norm.weight": (lin.head_v_dim,)}
    for name, shape in expected.items():
        if not get.has(p + name):
            raise ValueError(f"checkpoint is missing weight {get.label(p + name)} (a linear-attention layer)")
        got = tuple(get.weights.shape(p + name))
        if got != shape and not (name == "conv1d.weight" and got == (lin.conv_dim, lin.conv_kernel)):
            raise ValueError(f"weight {get.label(p + name)} is {list(got)}; this config needs {list(shape)}")
    conv = get(p + "conv1d.weight").reshape(lin.conv_dim, lin.conv_kernel).float().contiguous()
    a = get(p + decay).float()
    return DeltaNet(
        in_proj=get.linear([p + f"{n}.weight" for n in qkvz | ba]),
        out_proj=get.linear([p + "out_proj.weight"]),
        conv_weight=conv, dt_bias=get(p + "dt_bias").float(), neg_a=a if decay == "neg_A" else -a.exp(),
        norm=get.norm(p + "norm.weight", plus_one=False), order=projection_order(lin, fused_qkvz, fused_ba))


def dummy_model(cfg: ModelConfig, device: torch.device,
                dtype: torch.dtype) -> tuple[ModelConfig, DecoderModel]:
    """A tiny random one-layer model of the same family with the real vocabulary: the forward
    costs next to nothing, so benchmarks of the frontends are not limited by the model."""
    import dataclasses

    from unison.model.layers.rope import Rope

    # (one plain attention layer and a dense MLP, whatever the family's layers are)
    plain = dataclasses.replace(cfg.family, moe=None, linear_attention=False, attn_output_gate=False,
                                text_prefix="model.", attention_sinks=False, fused_experts=None)
    tiny = dataclasses.replace(cfg, family=plain, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               tie_word_embeddings=True, ropes=[Rope(32)], layer_rope=[0],
                               layer_window=[None], attention_scale=32 ** -0.5, moe=None,
                               layer_types=["full_attention"], linear=None, rotary_dim=0)
    g = torch.Generator().manual_seed(0)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    shapes = {"model.embed_tokens.weight": (tiny.vocab_size, 64), "model.norm.weight": (64,),
              a + "q_proj.weight": (64, 64), a + "k_proj.weight": (32, 64), a + "v_proj.weight": (32, 64),
              a + "o_proj.weight": (64, 64), m + "gate_proj.weight": (128, 64),
              m + "up_proj.weight": (128, 64), m + "down_proj.weight": (64, 128)}
    shapes |= {f"model.layers.0.{name}.weight": (64,) for name in cfg.family.norms.values()}
    weights = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()}
    return tiny, DecoderModel(tiny, DictWeights(weights), device, dtype)


def _loading(layers: int) -> Iterator[int]:
    """The layers' indices, shown when the core logs at info (`unison serve`'s default; `--quiet`
    and the Engine's default log less): a progress bar on a terminal, else one line at the end."""
    from tqdm import tqdm

    log = logging.getLogger("unison.core")
    shown, bar = log.isEnabledFor(logging.INFO), sys.stderr.isatty()
    t0 = time.monotonic()
    yield from tqdm(range(layers), desc="loading layers", unit="layer", disable=not (shown and bar),
                    leave=False)
    if shown and not bar:
        log.info("loaded %d layers in %.1f s", layers, time.monotonic() - t0)
