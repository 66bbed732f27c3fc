"""The per-machine store of Hugging Face references: a hit returns exactly what was computed, and
anything that decides a reference makes a new key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.references import cached_reference, cached_tensors

REFERENCE = [([5, 7], [{5: -0.1, 9: -2.5}, {7: -1 / 3, 1: -1e-9}]), ([2], [{2: -0.7, 3: -0.8}])]


@pytest.fixture
def store(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("UNISON_TEST_MODELS", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF weights")
    return model


def test_a_hit_returns_what_was_computed_without_computing(store: Path):
    calls = []

    def compute():
        calls.append(1)
        return REFERENCE

    first = cached_reference(store, "code", [[1, 2], [3]], 2, compute)
    again = cached_reference(store, "code", [[1, 2], [3]], 2, compute)
    assert first == again == REFERENCE and len(calls) == 1
    assert [list(top) for _, tops in again for top in tops] == [[5, 9], [7, 1], [2, 3]]  # rank order
    assert not list((store.parent / "cache" / "references").glob("*.partial"))


CHANGES = {"code": {"code": "code 2"}, "prompts": {"prompts_ids": [[1, 3]]},
           "max_new_tokens": {"max_new_tokens": 3}, "model": {}}


@pytest.mark.parametrize("change", CHANGES)
def test_what_decides_a_reference_is_in_its_key(store: Path, change: str):
    args = {"code": "code", "prompts_ids": [[1, 2]], "max_new_tokens": 2}
    cached_reference(store, **args, compute=lambda: REFERENCE)
    if change == "model":
        store.write_bytes(b"GGUF other weights")
    other = [([0], [{0: 0.0}])]
    assert cached_reference(store, **args | CHANGES[change], compute=lambda: other) == other


def test_tensors_come_back_equal_and_tied_as_they_were(store: Path):
    import torch

    embed = torch.randn(6, 4)
    tensors = {"embed.weight": embed, "norm.weight": torch.ones(4, dtype=torch.bfloat16),
               "lm_head.weight": embed, "proj.weight": torch.randn(4, 6).t()}  # tied; a transposed view
    first = cached_tensors(store, "code", lambda: tensors)
    again = cached_tensors(store, "code", lambda: pytest.fail("a hit must not compute"))
    for got in (first, again):
        assert list(got) == list(tensors)
        for name, tensor in tensors.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        assert got["lm_head.weight"].data_ptr() == got["embed.weight"].data_ptr()
