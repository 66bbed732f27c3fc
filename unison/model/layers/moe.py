"""A mixture of experts' MLP (Qwen3-MoE, Mixtral, OLMoE): a router picks each token's top-k
experts, each expert is a gated MLP, and the token's output is their sum weighted by the
router's softmax (renormalized over the k where the config says so). Qwen2-MoE, Qwen3-Next and
Qwen3.5-MoE add a `SharedExpert`, which every token runs.

`QuantMoe` runs on CPUs with the experts in their int4 / int8 blocks (csrc/moe.c: the step's
(row, expert) pairs grouped by expert, one GEMM per active expert, a fixed order of sums, so a
row's result is the same alone or in any batch). `FloatMoe` is the reference in torch, for
float weights on any device, computed as transformers computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from unison.model.families import MoeConfig
from unison.model.kernels import cpu_kernels
from unison.model.kernels.torch_ops import TorchOps
from unison.model.weights.quant import QuantWeight

if TYPE_CHECKING:
    from unison.model.layers.linears import Linear, QuantLinear

PROJECTIONS = ("gate", "up", "down")


@dataclass(slots=True)
class MoeBiases:
    """gpt-oss's biases (float32): the router's [experts], the experts' gate and up
    [experts, inter], down [experts, hidden]. Other families have none."""

    router: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return _bytes(self.router, self.gate, self.up, self.down)


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class FloatMoe:
    """The experts as float tensors [experts, rows, k], run expert by expert in torch."""

    def __init__(self, moe: MoeConfig, activation: str, router: torch.Tensor, gate: torch.Tensor,
                 up: torch.Tensor, down: torch.Tensor, biases: MoeBiases | None = None):
        self.cfg, self.activation, self.biases = moe, activation, biases
        self.router, self.gate, self.up, self.down = router, gate, up, down

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [rows, top_k], weights [rows, top_k]), as transformers' top-k routers."""
        bias = None if self.biases is None else self.biases.router.to(x.dtype)
        probs = torch.softmax(F.linear(x, self.router, bias).float(), dim=-1)
        weights, experts = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        b = self.biases
        for e in experts.unique().tolist():  # increasing: the order transformers adds them in
            rows, slot = torch.where(experts == e)
            h = x.index_select(0, rows)
            gate = F.linear(h, self.gate[e], None if b is None else b.gate[e].to(h.dtype))
            up = F.linear(h, self.up[e], None if b is None else b.up[e].to(h.dtype))
            y = F.linear(TorchOps.act_mul(torch.cat([gate, up], dim=-1), self.activation), self.down[e],
                         None if b is None else b.down[e].to(h.dtype))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    @property
    def nbytes(self) -> int:
        biases = 0 if self.biases is None else self.biases.nbytes
        return _bytes(self.router, self.gate, self.up, self.down) + biases

    @property
    def step_nbytes(self) -> int:
        """Bytes one row's step reads: the router and its top_k experts."""
        b = self.biases
        experts = _bytes(self.gate, self.up, self.down) + (0 if b is None else _bytes(b.gate, b.up, b.down))
        router = _bytes(self.router) + (0 if b is None else _bytes(b.router))
        return router + experts * self.cfg.top_k // self.cfg.num_experts

    @property
    def kind(self) -> str:
        return str(self.gate.dtype).removeprefix("torch.")


class QuantMoe:
    """The experts in the quantized kernel's blocks, one weight [experts, ...] per projection,
    run by csrc/moe.c (the compiled decoder calls it through `c`)."""

    def __init__(self, moe: MoeConfig, activation: str, router: torch.Tensor, gate: QuantWeight,
                 up: QuantWeight, down: QuantWeight, kernels: cpu_kernels.CpuKernels,
                 biases: MoeBiases | None = None):
        self.cfg, self.kernels = moe, kernels
        self.router = router.float().contiguous()
        self.weights = {"gate": gate, "up": up, "down": down}
        # (kept: the C struct points into them)
        self.biases = None if biases is None else MoeBiases(*(t.float().contiguous() for t in (
            biases.router, biases.gate, biases.up, biases.down)))

        def linear(w: QuantWeight) -> cpu_kernels.ExpertLinearC:
            return cpu_kernels.ExpertLinearC(w.format, w.packed.data_ptr(), w.n_padded, w.k)

        b = self.biases
        self.c = cpu_kernels.MoeLayerC(moe.num_experts, moe.top_k, gate.k, moe.intermediate_size,
                                       int(moe.norm_topk_prob), cpu_kernels.ACTIVATIONS[activation],
                                       self.router.data_ptr(), linear(gate), linear(up), linear(down),
                                       *([None] * 4 if b is None else [t.data_ptr() for t in (
                                           b.router, b.gate, b.up, b.down)]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.moe(x, self.c)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, weight = self.kernels.moe_route(x.float().contiguous(), self.c)
        return top.long(), weight

    @property
    def nbytes(self) -> int:
        biases = 0 if self.biases is None else self.biases.nbytes
        return _bytes(self.router) + sum(w.nbytes for w in self.weights.values()) + biases

    @property
    def step_nbytes(self) -> int:
        """Bytes one row's step reads: the router and its top_k experts."""
        b = self.biases
        experts = sum(w.nbytes for w in self.weights.values())
        experts += 0 if b is None else _bytes(b.gate, b.up, b.down)
        router = _bytes(self.router) + (0 if b is None else _bytes(b.router))
        return router + experts * self.cfg.top_k // self.cfg.num_experts

    @property
    def kind(self) -> str:
        return self.kernels.kinds(self.weights.values())


@dataclass(slots=True)
class SharedExpert:
    """A dense gated MLP that every token runs beside the routed experts, scaled by
    sigmoid(x . gate): its output is added to theirs (as transformers adds it: routed + shared)."""

    gate_up: Linear | QuantLinear
    down: Linear | QuantLinear
    gate: torch.Tensor  # [hidden]: the sigmoid gate's weight
    activation: str

    def __call__(self, x: torch.Tensor, ops: TorchOps | cpu_kernels.CpuKernels) -> torch.Tensor:
        y = self.down(ops.act_mul(self.gate_up(x), self.activation))
        return y.mul_(ops.row_gates(x, self.gate)[:, None])
