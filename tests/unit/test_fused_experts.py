"""Fused experts read one expert at a time: gpt-oss's interleaved gate and up, Qwen3-VL-MoE's halves
in the published [experts, in, out] order and in transformers 5's [experts, out, in]."""

from __future__ import annotations

import pytest
import torch

from unison.model.weights.gpt_oss import FusedExperts
from unison.model.weights.sources import DictWeights

E, HIDDEN, INTER = 3, 16, 12  # (2 * INTER != HIDDEN: a square gate_up is read as published)
P = "model.layers.0.mlp.experts."


def _experts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    return {f"{e}.{proj}": torch.randn(*shape, generator=g)
            for e in range(E) for proj, shape in shapes.items()}


def _fused(want: dict[str, torch.Tensor], layout: str, in_out: bool) -> dict[str, torch.Tensor]:
    pairs = [(want[f"{e}.gate"].T, want[f"{e}.up"].T) for e in range(E)]  # [in, out] each
    if layout == "interleaved":
        gate_up = torch.stack([torch.stack([g, u], -1).flatten(-2) for g, u in pairs])
    else:
        gate_up = torch.stack([torch.cat([g, u], -1) for g, u in pairs])
    down = torch.stack([want[f"{e}.down"].T for e in range(E)])
    if not in_out:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return {P + "gate_up_proj": gate_up.contiguous(), P + "down_proj": down.contiguous()}


@pytest.mark.parametrize("layout,in_out", [("interleaved", True), ("halves", True), ("halves", False)])
def test_each_expert_is_its_own_linear(layout: str, in_out: bool):
    want = _experts()
    source = FusedExperts(DictWeights(_fused(want, layout, in_out)), layout, HIDDEN)
    for e in range(E):
        for proj in ("gate", "up", "down"):
            name = f"{P}{e}.{proj}_proj.weight"
            assert name in source and source.shape(name) == tuple(want[f"{e}.{proj}"].shape)
            assert torch.equal(source.float(name), want[f"{e}.{proj}"]), (name, layout, in_out)
