"""gpt-oss: a tiny random GptOssConfig made with transformers (its fused, interleaved experts
with biases, the router's bias, attention sinks, a sliding window on every other layer, YaRN),
read from its Hugging Face directory, against transformers: greedy tokens and first-step
logprobs in float32 and on int8 weights, batch invariance, the compiled decoder against the
Python forward, and the configs it refuses by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_moe import PROMPTS, _prefill_and_decode
from tests.utils import _hf_greedy, greedy
from unison.model import cpu_kernels
from unison.model.families import ModelConfig
from unison.model.runner import ModelRunner

KERNELS = cpu_kernels.load()
VOCAB = 49152
NEW_TOKENS = 8
pytestmark = pytest.mark.skipif(KERNELS is None, reason="gpt-oss's attention sinks run on the C kernels")


def tiny_gpt_oss(path: Path, **changes) -> Path:
    """Two layers (one windowed, one full) of seeded random weights, widened so that positions,
    heads, sinks and routes all matter, saved by transformers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **changes)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
            if name.endswith("sinks"):
                p.mul_(3)  # some heads lean on their sink, some barely
    hf.config._attn_implementation = "eager"  # (the sinks: eager attention is the reference)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "tiny")


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    return _hf_greedy(hf, PROMPTS, NEW_TOKENS)


def test_config_reads_the_family(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.family.name == "gpt_oss" and cfg.moe is not None and cfg.moe.norm_topk_prob
    assert cfg.layer_window == [8, None]
    scaling = dict(cfg.ropes[0].scaling)
    assert scaling["rope_type"] == "yarn" and scaling["truncate"] is False


def test_matches_transformers_in_float32(model_dir, reference):
    """16 prompts together, 8 greedy tokens: equal to transformers' on at least 15; first-step top-5
    logprobs within 1e-3. The prompts run past the window of 8, so the windowed layer's masking
    counts."""
    runner = ModelRunner(model_dir, quantization="none", num_blocks=256, block_size=8)
    assert runner.config.family.name == "gpt_oss"
    got = greedy(runner, PROMPTS, NEW_TOKENS)
    same = sum(ids == ref_ids for (ids, _), (ref_ids, _) in zip(got, reference))
    first = torch.log_softmax(_prefill_and_decode(runner, PROMPTS)[0], dim=-1)
    worst = max(abs(row[t].item() - lp)
                for row, (_, ref_tops) in zip(first, reference) for t, lp in ref_tops[0].items())
    print(f"\n[figure] gpt-oss float32: greedy equal on {same}/16; first-step top-5 gap {worst:.2e}")
    assert same >= 15 and worst < 1e-3


def test_rows_are_bit_identical_alone_or_together_and_compiled_equals_python(model_dir, monkeypatch):
    runner = ModelRunner(model_dir, quantization="int8", num_blocks=256, block_size=8)
    assert runner._compiled is not None  # quantized on CPU: the compiled decoder
    together = _prefill_and_decode(runner, PROMPTS)
    for i in (0, 7, 15):
        alone = _prefill_and_decode(runner, [PROMPTS[i]])
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i]), i
    monkeypatch.setattr(runner, "_compiled", None)  # the Python forward, kernel by kernel
    python = _prefill_and_decode(runner, PROMPTS)
    assert torch.equal(python[0], together[0]) and torch.equal(python[1], together[1])


@pytest.mark.parametrize("change, match", [({"swiglu_limit": 5.0}, "swiglu_limit=5.0"),
                                           ({"swiglu_alpha": 2.0}, "swiglu_alpha=2.0")])
def test_variants_the_kernels_do_not_run_are_refused_by_name(model_dir, tmp_path, change, match):
    cfg = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**cfg, **change})


def test_a_missing_sink_is_named(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.sinks"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.self_attn.sinks"):
        ModelRunner(broken, quantization="none", num_blocks=16, block_size=8)
