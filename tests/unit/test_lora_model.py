"""LoRA adapters at the model runner: parity with transformers + PEFT on float, int8 and int4
bases, mixed batches bit-identical to rows alone, the compiled and Python forwards bit-identical,
and every adapter read_peft refuses, by its reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.adapters import make_adapter, peft_reference
from tests.unit.test_model import prompt_ids
from tests.utils import Blocks, assert_greedy_close, top_logprobs
from unison.model.families import ModelConfig
from unison.model.kernels import cpu_kernels
from unison.model.layers.lora import LORA_TARGETS, read_peft
from unison.model.runner import BatchItem, ModelRunner

KERNELS = cpu_kernels.load()
NEW_TOKENS = 12
QUALITY_GAP = 0.15  # tests/unit/test_quant.py's: quantized weights against float32
MAX_RANK = 16
# name -> make_adapter options; ids 1.. in this order
ADAPTERS = {
    "all": {"rank": 4, "seed": 1},
    "q-v": {"rank": 4, "seed": 2, "targets": ("q_proj", "v_proj")},
    "rslora-mlp": {"rank": 8, "alpha": 8, "seed": 3, "use_rslora": True,
                   "targets": ("gate_proj", "up_proj", "down_proj")},
    "k-o-up": {"rank": 2, "seed": 4, "targets": ("k_proj", "o_proj", "up_proj")},
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}
PARITY = ["all", "q-v", "rslora-mlp"]  # checked against PEFT; the last one only mixes in


class _Adapters(dict):
    """name -> the adapter's directory, made on first use (the tests of read_peft need one)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        self[name] = make_adapter(self.root / name, **ADAPTERS[name])
        return self[name]


def warm_references() -> None:
    """The background warmer's (tests/references.py): the PARITY adapters, made as the tests make
    them (seeded: the same bytes, so the same cache keys), and their transformers + PEFT references."""
    import tempfile

    from unison.model.weights.loader import resolve_model_dir

    ids = prompt_ids(resolve_model_dir(None))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _Adapters(Path(tmp))
        for name in PARITY:
            peft_reference(adapters[name], [ids[0], ids[2], ids[3], ids[6]], NEW_TOKENS)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    return _Adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def cfg(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dir(model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    ids = prompt_ids(model_dir)
    return [ids[0], ids[2], ids[3], ids[6]]  # plain text and a chat (warm_references' too)


@pytest.fixture(scope="module")
def references(adapter_dirs, prompts):
    return {name: peft_reference(adapter_dirs[name], prompts, NEW_TOKENS) for name in PARITY}


@pytest.fixture(scope="module")
def runners(adapter_dirs) -> dict[str, ModelRunner]:
    kinds = ("none", "int8", "int4") if KERNELS is not None else ("none",)
    out = {}
    for kind in kinds:
        runner = ModelRunner(None, quantization=kind, num_blocks=160)
        for name in ADAPTERS:
            runner.add_lora(IDS[name], read_peft(adapter_dirs[name], runner.config, MAX_RANK))
        out[kind] = runner
    return out


def _runner(runners, kind: str) -> ModelRunner:
    if kind not in runners:
        pytest.skip("no C compiler here: no quantized kernels")
    return runners[kind]


def greedy(runner: ModelRunner, requests: list[tuple[list[int], int]], new_tokens: int):
    """(prompt, adapter) requests in lockstep, all in every step: (ids, top-5 per step) each."""
    blocks = Blocks(runner)
    batch = [BatchItem(list(p), 0, blocks.table(len(p) + new_tokens), len(p) - 1, a) for p, a in requests]
    outs = [([], []) for _ in requests]
    for _ in range(new_tokens):
        logits = runner.forward(batch)
        for (ids, tops), top, row in zip(outs, top_logprobs(logits), logits):
            ids.append(int(row.argmax()))
            tops.append(top)
        batch = [BatchItem([ids[-1]], b.start_pos + len(b.token_ids), b.block_table, 0, b.adapter)
                 for b, (ids, _) in zip(batch, outs)]
    return outs


@pytest.fixture(scope="module")
def greedy_runs(runners, prompts):
    """Every kind, each parity adapter on every prompt, all in one batch (mixed adapters)."""
    requests = [(p, IDS[name]) for name in PARITY for p in prompts]
    return {kind: greedy(runner, requests, NEW_TOKENS) for kind, runner in runners.items()}


# ---- parity with transformers + PEFT ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["none", "int8", "int4"])
def test_greedy_matches_peft(runners, greedy_runs, references, prompts, kind: str):
    _runner(runners, kind)
    got = iter(greedy_runs[kind])
    for name in PARITY:
        for i, (ref_ids, ref_top) in enumerate(references[name]):
            ids, tops = next(got)
            assert_greedy_close(ref_ids, ref_top, ids, tops, name=f"{kind} {name} prompt {i}",
                                max_gap=QUALITY_GAP if kind != "none" else 0.1)


@pytest.mark.parametrize("kind", ["none", "int8", "int4"])
def test_first_step_logprobs_match_peft(runners, greedy_runs, references, kind: str):
    _runner(runners, kind)
    worst = 0.0
    got = iter(greedy_runs[kind])
    for name in PARITY:
        for _, ref_top in references[name]:
            _, tops = next(got)
            worst = max(worst, *(abs(tops[0].get(t, -1e9) - lp) for t, lp in ref_top[0].items()))
    print(f"\n[figure] LoRA on {kind}: largest first-step top-5 logprob difference from PEFT: {worst:.5f}")
    assert worst < (1e-3 if kind == "none" else QUALITY_GAP)


def test_the_adapters_change_the_outputs(runners, greedy_runs, prompts):
    """Otherwise the parity above would hold for a runner that ignores them."""
    runner = runners["none"]
    blocks = Blocks(runner)
    base = top_logprobs(runner.forward([BatchItem(p, 0, blocks.table(len(p)), len(p) - 1) for p in prompts]))
    got = iter(greedy_runs["none"])
    for name in PARITY:
        moved = [max(abs(tops[0].get(t, -1e9) - lp) for t, lp in b.items())
                 for b, (_, tops) in zip(base, got)]
        assert max(moved) > 0.05, (name, moved)


# ---- what the forward computes, bit for bit ---------------------------------------------------

def _mixed_batch(prompts: list[list[int]], runner: ModelRunner) -> list[tuple[list[int], int]]:
    """16 requests on the 4 adapters and the base, with lengths of their own."""
    adapters = [0, *IDS.values()]
    return [(prompts[i % len(prompts)][: 5 + i], adapters[i % len(adapters)]) for i in range(16)]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_mixed_adapters_are_batch_invariant(runners, prompts, kind: str):
    """16 requests on 4 adapters and the base, prefilled and decoded together, give the bits each
    gives alone (quantized bases: their linears are batch invariant, and so is the update)."""
    runner = _runner(runners, kind)
    requests = _mixed_batch(prompts, runner)
    blocks = Blocks(runner)
    tables = [blocks.table(len(p) + 1) for p, _ in requests]
    prefill = [BatchItem(p, 0, t, 0, a) for (p, a), t in zip(requests, tables)]
    decode = [BatchItem([7 + i], len(p), t, 0, a) for i, ((p, a), t) in enumerate(zip(requests, tables))]
    together = [runner.forward(prefill), runner.forward(decode)]
    row = 0
    for i, (item, step) in enumerate(zip(prefill, decode)):
        alone = runner.forward([item])
        assert torch.equal(alone, together[0][row: row + len(item.token_ids)]), f"prefill {i}"
        assert torch.equal(runner.forward([step]), together[1][i: i + 1]), f"decode {i}"
        row += len(item.token_ids)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compiled_and_python_forwards_are_bit_identical(runners, prompts, kind: str, monkeypatch):
    """Quantized steps with adapters stay on the one C call (csrc/decoder.c); the Python forward
    runs the same update in the same places."""
    runner = _runner(runners, kind)
    assert runner._compiled is not None
    requests = _mixed_batch(prompts, runner)
    blocks = Blocks(runner)
    batch = [BatchItem(p, 0, blocks.table(len(p)), len(p) // 2, a) for p, a in requests]
    first = runner.forward(batch)
    monkeypatch.setattr(runner, "_compiled", None)
    assert torch.equal(runner.forward(batch), first)


def test_torch_update_is_the_kernels_within_rounding(runners, prompts, monkeypatch):
    """Without the C kernels (CUDA, or no compiler) torch runs the update per adapter."""
    runner = runners["none"]
    if runner._kernel is None:
        pytest.skip("no C compiler here: the runner already runs on torch")
    blocks = Blocks(runner)
    batch = [BatchItem(p, 0, blocks.table(len(p)), 0, a) for p, a in _mixed_batch(prompts, runner)[:6]]
    kernel = runner.forward(batch)
    monkeypatch.setattr(runner, "_kernel", None)
    torch.testing.assert_close(runner.forward(batch), kernel, rtol=1e-4, atol=3e-4)


def test_adapters_are_added_and_removed_by_id(runners, adapter_dirs):
    runner = runners["none"]
    weights = read_peft(adapter_dirs["q-v"], runner.config, MAX_RANK)
    assert (weights.rank, weights.alpha, weights.scale) == (4, 16.0, 4.0)
    assert weights.targets == ("q_proj", "v_proj")
    assert weights.nbytes == 4 * runner.config.num_hidden_layers * (8 * 576 * 2 + 4 * (576 + 192))  # A padded
    a, b = weights.layers[0][0][1].plain()  # v_proj
    peft = load_file(adapter_dirs["q-v"] / "adapter_model.safetensors")
    v = "base_model.model.model.layers.0.self_attn.v_proj.lora_{}.weight"
    assert torch.equal(a, peft[v.format("A")].t()) and torch.equal(b, peft[v.format("B")].t() * 4.0)
    with pytest.raises(ValueError, match="already loaded"):
        runner.add_lora(IDS["q-v"], weights)
    with pytest.raises(ValueError, match="0 is the base model"):
        runner.add_lora(0, weights)
    runner.add_lora(99, weights)
    runner.remove_lora(99)
    with pytest.raises(ValueError, match=r"\[99\] are not loaded"):
        runner.forward([BatchItem([1, 2], 0, [0], 1, 99)])
    with pytest.raises(ValueError, match="not loaded"):
        runner.remove_lora(99)


# ---- reading PEFT's files: what is honoured, what is refused ------------------------------------

def _edited(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of adapter `src` with config keys replaced and tensors edited by tensors(dict)."""
    shutil.copytree(src, dst)
    if config is not None:
        doc = json.loads((dst / "adapter_config.json").read_text()) | config
        (dst / "adapter_config.json").write_text(json.dumps(doc))
    if tensors is not None:
        state = load_file(dst / "adapter_model.safetensors")
        tensors(state)
        save_file(state, dst / "adapter_model.safetensors")
    return dst


Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def test_target_regex_rank_and_alpha_patterns_and_layers_are_honoured(cfg, adapter_dirs, tmp_path):
    src = adapter_dirs["q-v"]
    plain = read_peft(src, cfg, MAX_RANK)

    def narrow_q0(state):  # layer 0's q_proj at rank 2
        a, b = state[Q0.format("A")], state[Q0.format("B")]
        state[Q0.format("A")], state[Q0.format("B")] = a[:2].contiguous(), b[:, :2].contiguous()

    patterned = read_peft(_edited(src, tmp_path / "p", {
        "target_modules": r".*\.(q_proj|v_proj)", "rank_pattern": {"layers.0.self_attn.q_proj": 2},
        "alpha_pattern": {"v_proj": 32}}, narrow_q0), cfg, MAX_RANK)
    q0, v0 = patterned.layers[0][0]
    (qa, qb), (pa, pb) = q0.plain(), plain.layers[0][0][0].plain()
    assert q0.rank == 2 and torch.equal(qb, pb[:2] * 2) and torch.equal(qa, pa[:, :2])  # scale 16 / 2
    assert torch.equal(v0.plain()[1], plain.layers[0][0][1].plain()[1] * 2) and v0.offset == 576 + 192
    assert patterned.rank == 4 and patterned.targets == ("q_proj", "v_proj")

    def layers_0_1(state):
        for key in [k for k in state if not k.startswith(("base_model.model.model.layers.0.",
                                                           "base_model.model.model.layers.1."))]:
            del state[key]

    some = read_peft(_edited(src, tmp_path / "l", {"layers_to_transform": [0, 1]}, layers_0_1), cfg, MAX_RANK)
    assert [len(layer[0]) for layer in some.layers] == [2, 2] + [0] * (cfg.num_hidden_layers - 2)
    with pytest.raises(ValueError, match="layers_to_transform"):
        read_peft(_edited(src, tmp_path / "l2", {"layers_to_transform": [0, 1]}), cfg, MAX_RANK)


def test_rslora_scale(cfg, adapter_dirs):
    weights = read_peft(adapter_dirs["rslora-mlp"], cfg, MAX_RANK)
    assert weights.scale == 8 / 8 ** 0.5 and weights.targets == ("gate_proj", "up_proj", "down_proj")


def _lm_head(state):
    state["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 576)
    state["base_model.model.lm_head.lora_B.weight"] = torch.zeros(49152, 4)


def _fc1(state):
    state["base_model.model.model.layers.0.mlp.fc1.lora_A.weight"] = torch.zeros(4, 576)
    state["base_model.model.model.layers.0.mlp.fc1.lora_B.weight"] = torch.zeros(576, 4)


def _layer_30(state):
    for ab in "AB":
        state[Q0.format(ab).replace("layers.0.", "layers.30.")] = state[Q0.format(ab)].clone()


def _wide(state):
    state[Q0.format("A")] = torch.zeros(4, 600)


def _integer(state):
    state[Q0.format("B")] = state[Q0.format("B")].to(torch.int32)


def _rank_32(state):  # every module's A and B repeated 8 times along the rank
    state.update({k: torch.cat([v] * 8, int(k.endswith("B.weight"))) for k, v in state.items()})


def _missing_b(state):
    del state[Q0.format("B")]


REFUSALS = {  # case -> (config changes, tensor edit, what the message says)
    "lm_head target": ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, None, "'lm_head'.*not supported"),
    "lm_head weights": ({}, _lm_head, "adapts lm_head, which is not supported"),
    "embed_tokens target": ({"target_modules": ["embed_tokens", "q_proj", "v_proj"]}, None,
                            "'embed_tokens'.*not supported"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "dora": ({"use_dora": True}, None, "use_dora"),
    "bias": ({"bias": "all"}, None, "bias='all'"),
    "rank above the maximum": ({"r": 32}, _rank_32, "rank 32, above the maximum LoRA rank 16"),
    "fc1 target": ({"target_modules": ["q_proj", "v_proj", "fc1"]}, None, "'fc1', a module the base model"),
    "fc1 weights": ({}, _fc1, "fc1.lora_A.weight' is not a LoRA weight of a module the base model"),
    "layer beyond the model": ({}, _layer_30, "adapts layer 30; the base model has 30 layers"),
    "shape": ({}, _wide, r"q_proj's lora_A \[4, 600\].*do not fit the base model's linear \(576 x 576\)"),
    "integer tensor": ({}, _integer, "is int32: a floating-point tensor is needed"),
    "A without B": ({}, _missing_b, "no lora_B for layers.0.q_proj"),
    "rank_pattern disagrees": ({"rank_pattern": {"q_proj": 8}}, None, "has rank 4;.*says r=8"),
    "not LoRA": ({"peft_type": "IA3"}, None, "peft_type 'IA3' is not LORA"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_by_reason(cfg, adapter_dirs, tmp_path, case: str):
    config, tensors, message = REFUSALS[case]
    path = _edited(adapter_dirs["q-v"], tmp_path / "a", config, tensors)
    with pytest.raises(ValueError, match=message):
        read_peft(path, cfg, MAX_RANK)


def test_missing_files_are_refused(cfg, adapter_dirs, tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        read_peft(tmp_path / "nowhere", cfg, MAX_RANK)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        path = _edited(adapter_dirs["q-v"], tmp_path / name)
        (path / name).unlink()
        with pytest.raises(ValueError, match=f"has no {name}"):
            read_peft(path, cfg, MAX_RANK)


def test_every_target_is_known():
    assert LORA_TARGETS == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- every family: the hooks sit where PEFT's updates do ----------------------------------------

@pytest.mark.parametrize("kind", ["qwen2-qkv-bias", "qwen3-qk-norm", "gemma3-window-across-chunks",
                                  "olmo2-post-norms"])
def test_every_family_matches_peft_and_both_forwards_agree(kind: str, tmp_path: Path, monkeypatch):
    """Tiny random models of the families whose layers differ (q/k/v bias, q/k norms, sandwich and
    post norms): float logits as PEFT's, and int4 steps with an adapter bit-identical on the
    compiled and the Python forward."""
    from tests.adapters import peft_model
    from tests.unit.test_model import assert_logits_close, tiny_model

    tiny_model(kind, tmp_path / "model")
    adapter = make_adapter(tmp_path / "lora", rank=4, seed=5, model_dir=tmp_path / "model")
    ids = torch.randint(0, 256, (20,)).tolist()
    with torch.inference_mode():
        ref = peft_model(adapter, tmp_path / "model")(torch.tensor([ids])).logits[0]
    for quantization in ("none", "int4") if KERNELS is not None else ("none",):
        runner = ModelRunner(tmp_path / "model", quantization=quantization, num_blocks=16, block_size=4)
        runner.add_lora(1, read_peft(adapter, runner.config, MAX_RANK))
        batch = [BatchItem(ids[:13], 0, [0, 1, 2, 3], 0, 0), BatchItem(ids, 0, list(range(4, 9)), 0, 1)]
        got = runner.forward(batch)
        if quantization == "none":
            assert_logits_close(got[13:], ref, kind)
            continue
        monkeypatch.setattr(runner, "_compiled", None)
        assert torch.equal(runner.forward(batch), got)
