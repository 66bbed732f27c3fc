"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5.

A layer keeps, per request, a fixed-size state instead of KV: the causal convolution's last K-1
inputs and the delta rule's matrix S per value head. `DeltaStates` holds every request's state, by
slot, for every such layer (the core's StatePool hands out the slots); `DeltaNet` is one layer's
weights and forward:

  q|k|v, z, b, a = projections of x          (Qwen3-Next's fused, interleaved ones reordered)
  q, k, v = silu(causal_conv(q|k|v))         the state holds the last K-1 inputs
  g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
  o = the gated delta rule over the state    (csrc/gated_delta.c: one token at a time, float32)
  out = out_proj(rms_norm(o per head) * w * silu(z))

Prefill and decode run one recurrence, a token at a time, with one order of sums, so a request's
output does not depend on how the scheduler chunked its prompt or what else ran beside it.
`delta_rule_reference` is the same recurrence in torch, for devices without the C kernels and
for the tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from unison.model.families import DeltaNetConfig
from unison.model.kernels import cpu_kernels
from unison.model.kernels.cpu_kernels import DeltaStep
from unison.model.layers.attention import lazy_zeros

if TYPE_CHECKING:
    from unison.model.kernels.torch_ops import TorchOps
    from unison.model.layers.linears import Linear, QuantLinear


@dataclass(slots=True)
class DeltaNet:
    """One linear-attention layer. `in_proj` gives [q|k|v, z, b, a] side by side; `order`, when
    set, is the column order that turns a fused checkpoint's output into that layout."""

    in_proj: Linear | QuantLinear
    out_proj: Linear | QuantLinear
    conv_weight: torch.Tensor  # [conv_dim, K]
    dt_bias: torch.Tensor  # [value heads]
    neg_a: torch.Tensor  # -exp(A_log), [value heads], float32
    norm: torch.Tensor  # [head_v_dim]: the gated RMSNorm's weight, applied as is (not 1 + w)
    order: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, index: int, cfg: DeltaNetConfig, states: DeltaStates,
                ops: TorchOps | cpu_kernels.CpuKernels, eps: float) -> torch.Tensor:
        """The layer's output [rows, hidden] for the step's rows x, reading and advancing the
        states of linear layer number `index` (`ops`: decoder.TorchOps or the C kernels)."""
        proj = self.in_proj(x)
        if self.order is not None:
            proj = proj.index_select(1, self.order)
        c, vd, hv = cfg.conv_dim, cfg.value_dim, cfg.num_v_heads
        qkv, z = proj[:, :c], proj[:, c: c + vd]
        b, a = proj[:, c + vd: c + vd + hv], proj[:, c + vd + hv:]
        g, beta = ops.delta_gates(a, b, self.dt_bias, self.neg_a)
        if states.drafted:
            states.record(index, qkv, g, beta)
        conv, rec = states.layer(index)
        o = self.recurrence(qkv, g, beta, conv, rec, states.current, cfg, ops)
        ops.norm_groups_(o, hv, cfg.head_v_dim, self.norm, eps)
        ops.mul_act_(o, z, "silu")
        return self.out_proj(o)

    def recurrence(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv: torch.Tensor,
                   rec: torch.Tensor, step: DeltaStep, cfg: DeltaNetConfig,
                   ops: TorchOps | cpu_kernels.CpuKernels) -> torch.Tensor:
        """The convolution and the delta rule over `step`'s rows, on the C kernel where it runs."""
        if isinstance(ops, cpu_kernels.CpuKernels):
            return ops.gated_delta(x, g, beta, self.conv_weight, conv, rec, step, cfg.tiled)
        return delta_rule_reference(x, g, beta, self.conv_weight, conv, rec, step, cfg)


def projection_order(cfg: DeltaNetConfig, fused_qkvz: bool, fused_ba: bool) -> torch.Tensor | None:
    """The column order that lays the input projections' output out as [q|k|v, z, b, a], where a
    checkpoint interleaves them per key head: Qwen3-Next's in_proj_qkvz [q, k, v..., z...] and
    in_proj_ba [b..., a...] (llama.cpp's converter splits the first into q|k|v and z, and keeps
    the second). None where they come in that order already."""
    if not (fused_qkvz or fused_ba):
        return None
    hk, dk, dv, r = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads // cfg.num_k_heads
    if fused_qkvz:
        per = 2 * dk + 2 * r * dv  # one key head's group
        group = np.arange(hk * per).reshape(hk, per)
        v_end = 2 * dk + r * dv
        qkvz = [group[:, :dk], group[:, dk: 2 * dk], group[:, 2 * dk: v_end], group[:, v_end:]]
    else:
        qkvz = [np.arange(cfg.conv_dim + cfg.value_dim)]
    base = cfg.conv_dim + cfg.value_dim
    if fused_ba:
        ba = base + np.arange(2 * cfg.num_v_heads).reshape(hk, 2 * r)
        b_a = [ba[:, :r], ba[:, r:]]
    else:
        b_a = [base + np.arange(2 * cfg.num_v_heads)]
    return torch.from_numpy(np.concatenate([p.reshape(-1) for p in qkvz + b_a]))


class StateItem(Protocol):
    """What a step's item says of its state (runner.BatchItem has these)."""

    token_ids: list[int]
    start_pos: int
    state_slot: int
    state_restore: int
    state_save: int
    drafted: bool


class DeltaStates:
    """Every request's linear-attention state, by slot: per linear layer, conv [slots, K-1,
    conv_dim] and rec [slots, value heads, dk, dv], float32. Slots [0, slots) are running
    requests'; the `snapshots` after them are the prefix cache's copies, each the state after a
    cached prefix. A forward opens `begin` with its items' slots and rows: a request that starts
    at position 0 has its slot zeroed, one that resumes a cached prefix has the snapshot copied in.

    Speculative decoding: a drafted item's state is kept as it was before the step, and each
    linear layer records the inputs of its rows; once the draft is verified, `rewind` goes back to
    that state and DecoderModel.replay_states runs the recurrence over the rows kept only: what
    plain decoding would have computed, bit for bit."""

    def __init__(self, cfg: DeltaNetConfig, layers: int, slots: int, device: torch.device,
                 snapshots: int = 0):
        self.cfg, self.slots, self.snapshots = cfg, slots, snapshots
        total = slots + snapshots  # lazily zeroed pages on CPU: a slot costs memory once used
        self.conv = lazy_zeros((layers, total, cfg.conv_kernel - 1, cfg.conv_dim), device)
        self.rec = lazy_zeros((layers, total, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim), device)
        self._step: DeltaStep | None = None
        self.drafted: dict[int, _Drafted] = {}  # slot -> its state before the step, rows recorded

    @staticmethod
    def slot_bytes(cfg: DeltaNetConfig, layers: int) -> int:
        return 4 * layers * cfg.state_floats

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.rec.nbytes

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[index], self.rec[index]

    @property
    def current(self) -> DeltaStep:
        assert self._step is not None  # set by begin() for the forward's duration
        return self._step

    @contextmanager
    def step(self, batch: Sequence[StateItem]) -> Iterator[DeltaStates]:
        """These states, open for a forward over `batch` (runner.BatchItem's): begin, and at the
        end keep the snapshots the items ask for, once the forward has run whole."""
        self.begin([item.state_slot for item in batch], [len(item.token_ids) for item in batch],
                   [item.state_slot for item in batch if item.start_pos == 0],
                   [(item.state_restore, item.state_slot) for item in batch if item.state_restore >= 0],
                   [item.state_slot for item in batch if item.drafted])
        done = False
        try:
            yield self
            done = True
        finally:
            self.end([(item.state_slot, item.state_save) for item in batch if item.state_save >= 0 and done])

    def begin(self, slots: list[int], counts: list[int], fresh: list[int],
              restore: Sequence[tuple[int, int]] = (), drafted: Sequence[int] = ()) -> None:
        """The step's items: their slots, their row counts (in batch order), the slots of those
        that start a sequence (zeroed now), (snapshot, slot) pairs of those that resume one, and
        the slots whose rows are a draft after a real token (kept to roll back to)."""
        bad = [s for s in slots if not 0 <= s < self.slots]
        bad += [s for s, _ in restore if not self.slots <= s < self.slots + self.snapshots]
        if bad:
            raise ValueError(f"bad batch item: linear-attention state slot {bad[0]} is not a "
                             f"{'running' if bad[0] in slots else 'snapshot'} slot")
        if fresh:
            index = torch.tensor(fresh, dtype=torch.int64, device=self.conv.device)
            self.conv.index_fill_(1, index, 0.0)
            self.rec.index_fill_(1, index, 0.0)
        for src, dst in restore:
            self.copy(src, dst)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._step = DeltaStep(torch.tensor(slots, dtype=torch.int64), torch.from_numpy(starts),
                               torch.tensor(counts, dtype=torch.int64))
        where = {slot: (int(start), n) for slot, start, n in zip(slots, starts, counts)}
        self.drafted = {slot: _Drafted(self.conv[:, slot].clone(), self.rec[:, slot].clone(), *where[slot])
                        for slot in drafted}

    def record(self, index: int, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """Linear layer `index`'s inputs this step (q|k|v before the convolution, g, beta): the
        drafted items' rows are kept for a replay."""
        for d in self.drafted.values():
            rows = slice(d.row_start, d.row_start + d.rows)
            d.inputs.append((x[rows].clone(), g[rows].clone(), beta[rows].clone()))

    def rewind(self, kept: dict[int, int]) -> DeltaStep | None:
        """Back to the drafted slots' states before the step, where fewer than all their rows
        were kept (`kept`: slot -> rows); the step a replay runs, over those rows (None: none)."""
        back = {s: n for s, n in kept.items() if s in self.drafted and n < self.drafted[s].rows}
        for slot in back:
            self.conv[:, slot] = self.drafted[slot].conv
            self.rec[:, slot] = self.drafted[slot].rec
        if not back:
            return None
        counts = list(back.values())
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        return DeltaStep(torch.tensor(list(back), dtype=torch.int64), torch.from_numpy(starts),
                         torch.tensor(counts, dtype=torch.int64))

    def replay_inputs(self, index: int, step: DeltaStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Linear layer `index`'s recorded (x, g, beta) for a replay `step`'s rows, side by side."""
        parts = [self.drafted[slot].inputs[index] for slot in step.slots.tolist()]
        kept = step.row_count.tolist()
        x, g, beta = (torch.cat([p[i][:n] for p, n in zip(parts, kept)]) for i in range(3))
        return x, g, beta

    def end(self, save: Sequence[tuple[int, int]] = ()) -> None:
        """The forward is done: (slot, snapshot) pairs keep a copy of a state (the prefix cache's)."""
        self._step = None
        for src, dst in save:
            self.copy(src, dst)

    def forget_drafts(self) -> None:
        self.drafted = {}

    def copy(self, src: int, dst: int) -> None:
        self.conv[:, dst] = self.conv[:, src]
        self.rec[:, dst] = self.rec[:, src]


@dataclass(slots=True)
class _Drafted:
    """A drafted item's state before its step, where its rows were, and each linear layer's inputs."""

    conv: torch.Tensor
    rec: torch.Tensor
    row_start: int
    rows: int
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def delta_rule_reference(x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                         conv_state: torch.Tensor, rec_state: torch.Tensor, step: DeltaStep,
                         cfg: DeltaNetConfig) -> torch.Tensor:
    """csrc/gated_delta.c in torch, as transformers' recurrent form computes it: any device."""
    hk, hv, dk, dv, K = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_kernel
    out = torch.empty(x.shape[0], hv * dv, dtype=torch.float32, device=x.device)

    def per_value_head(t: torch.Tensor) -> torch.Tensor:  # [n, hk, dk] -> [n, hv, dk]
        return t.repeat(1, hv // hk, 1) if cfg.tiled else t.repeat_interleave(hv // hk, dim=1)

    for slot, r0, n in zip(step.slots.tolist(), step.row_start.tolist(), step.row_count.tolist()):
        rows = torch.cat([conv_state[slot], x[r0: r0 + n].float()])  # [K-1 + n, conv_dim]
        conv_state[slot] = rows[-(K - 1):]
        c = F.silu(F.conv1d(rows.T[None], conv_weight[:, None], groups=cfg.conv_dim)[0].T)  # [n, conv_dim]
        q = per_value_head(c[:, : hk * dk].reshape(n, hk, dk))
        k = per_value_head(c[:, hk * dk: 2 * hk * dk].reshape(n, hk, dk))
        v = c[:, 2 * hk * dk:].reshape(n, hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk ** 0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        S = rec_state[slot]
        for t in range(n):
            S.mul_(g[r0 + t].exp()[:, None, None])
            delta = (v[t] - (S * k[t][:, :, None]).sum(1)) * beta[r0 + t][:, None]
            S.add_(k[t][:, :, None] * delta[:, None, :])
            out[r0 + t] = (S * q[t][:, :, None]).sum(1).reshape(-1)
    return out
