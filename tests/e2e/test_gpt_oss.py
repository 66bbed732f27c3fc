"""gpt-oss: a tiny random GptOssConfig made with transformers (its fused, interleaved experts
with biases, the router's bias, attention sinks, a sliding window on every other layer, YaRN),
read from its Hugging Face directory and from a GGUF written as llama.cpp's converter writes it
(MXFP4 experts, Q8_0 linears), against transformers: greedy tokens and first-step logprobs,
batch invariance, the compiled decoder against the Python forward, and what it refuses by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.test_moe import PROMPTS, QUANTIZED_GAP, _prefill_and_decode
from tests.utils import _hf_greedy, greedy
from unison.model.families import ModelConfig
from unison.model.kernels import cpu_kernels
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


def write_gguf(model_dir: Path, out: Path, experts: str = "MXFP4", narrow: str | None = None) -> Path:
    """llama.cpp's converter's gpt-oss file: gate and up split out of the fused tensor (and its
    bias), experts stacked [experts, rows, k] in `experts`' blocks, attention and head in Q8_0,
    norms, sinks and biases in F32; the embedded tokenizer. `narrow`: a tensor written with half
    its rows (a broken file)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from unison.bench.model import copy_fields, embedded_tokenizer
    from unison.model.weights.sources import SafetensorsWeights

    cfg = json.loads((model_dir / "config.json").read_text())
    src = SafetensorsWeights(model_dir)
    w = GGUFWriter(out, "gpt-oss")
    for key, value in [("block_count", cfg["num_hidden_layers"]), ("context_length", 4096),
                       ("embedding_length", cfg["hidden_size"]), ("head_count", cfg["num_attention_heads"]),
                       ("head_count_kv", cfg["num_key_value_heads"]), ("key_length", cfg["head_dim"]),
                       ("value_length", cfg["head_dim"]),
                       ("rope_freq_base", cfg["rope_parameters"]["rope_theta"]),
                       ("layer_norm_rms_eps", cfg["rms_norm_eps"]), ("vocab_size", VOCAB),
                       ("expert_count", cfg["num_local_experts"]),
                       ("expert_used_count", cfg["num_experts_per_tok"]),
                       ("expert_feed_forward_length", cfg["intermediate_size"]),
                       ("sliding_window", cfg["sliding_window"])]:
        getattr(w, f"add_{key}")(value)
    w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg["rope_parameters"]["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg["rope_parameters"]["original_max_position_embeddings"])
    copy_fields(w, embedded_tokenizer())

    def add(name: str, t: torch.Tensor, kind: str = "F32") -> None:
        a = t.float().numpy()
        if name == narrow:
            a = a[..., : a.shape[-2] // 2, :]
        if kind == "F32":
            w.add_tensor(name, a)
        else:
            q = GGMLQuantizationType[kind]
            w.add_tensor(name, quants.quantize(a, q), raw_dtype=q)

    add("token_embd.weight", src.float("model.embed_tokens.weight"), "Q8_0")
    add("output_norm.weight", src.float("model.norm.weight"))
    add("output.weight", src.float("lm_head.weight"), "Q8_0")
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", src.float(p + "input_layernorm.weight"))
        add(b + "post_attention_norm.weight", src.float(p + "post_attention_layernorm.weight"))
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            add(b + f"attn_{g}.weight", src.float(p + f"self_attn.{h}_proj.weight"), "Q8_0")
            add(b + f"attn_{g}.bias", src.float(p + f"self_attn.{h}_proj.bias"))
        add(b + "attn_sinks.weight", src.float(p + "self_attn.sinks"))
        add(b + "ffn_gate_inp.weight", src.float(p + "mlp.router.weight"))
        add(b + "ffn_gate_inp.bias", src.float(p + "mlp.router.bias"))
        gate_up = src.float(p + "mlp.experts.gate_up_proj")
        bias = src.float(p + "mlp.experts.gate_up_proj_bias")
        add(b + "ffn_gate_exps.weight", gate_up[..., 0::2].transpose(1, 2), experts)  # [E, inter, hidden]
        add(b + "ffn_up_exps.weight", gate_up[..., 1::2].transpose(1, 2), experts)
        add(b + "ffn_gate_exps.bias", bias[:, 0::2])
        add(b + "ffn_up_exps.bias", bias[:, 1::2])
        add(b + "ffn_down_exps.weight", src.float(p + "mlp.experts.down_proj").transpose(1, 2), experts)
        add(b + "ffn_down_exps.bias", src.float(p + "mlp.experts.down_proj_bias"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_dir(gguf: Path, model_dir: Path, out: Path) -> Path:
    """The GGUF's tensors dequantized by gguf's own code, fused back into transformers' layout:
    transformers' reference for the quantized file."""
    from safetensors.torch import save_file

    from unison.model.weights.gguf import GGUFWeights, hf_config, open_gguf

    out.mkdir()
    (out / "config.json").write_text((model_dir / "config.json").read_text())
    weights = GGUFWeights(gguf, hf_config(open_gguf(gguf)))
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = {n: weights.float(n).contiguous() for n in weights.names() if ".mlp.experts." not in n}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        per = {(e, proj, kind): weights.float(f"{p}{e}.{proj}_proj.{kind}")
               for e in range(cfg["num_local_experts"]) for proj in ("gate", "up", "down")
               for kind in ("weight", "bias")}
        experts = range(cfg["num_local_experts"])
        gate_up = torch.stack([torch.stack([per[e, "gate", "weight"].T, per[e, "up", "weight"].T], -1)
                               .flatten(-2) for e in experts])
        gate_up_bias = torch.stack([torch.stack([per[e, "gate", "bias"], per[e, "up", "bias"]], -1).flatten()
                                    for e in experts])
        tensors |= {p + "gate_up_proj": gate_up, p + "gate_up_proj_bias": gate_up_bias,
                    p + "down_proj": torch.stack([per[e, "down", "weight"].T for e in experts]).contiguous(),
                    p + "down_proj_bias": torch.stack([per[e, "down", "bias"] for e in experts])}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


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


def test_an_mxfp4_gguf_runs_its_experts_as_stored_and_matches_transformers(model_dir, tmp_path):
    """The file's MXFP4 experts run as stored (mxfp4 records at the file's bytes), against
    transformers on the file's dequantized weights: greedy equal on at least 15 of 16, first-step
    top-5 logprobs within the bound 16-bit activations give the dense families' quantized files."""
    gguf = write_gguf(model_dir, tmp_path / "tiny-mxfp4.gguf")
    ref = _hf_greedy(_hf(dequantized_dir(gguf, model_dir, tmp_path / "ref")), PROMPTS, NEW_TOKENS)
    runner = ModelRunner(gguf, num_blocks=256, block_size=8)
    kinds = runner.model.linear_kinds()
    assert kinds["layers.1.experts"] == f"mxfp4/{KERNELS.quant_path}"
    assert kinds["layers.0.qkv"].startswith("q8_0")
    moe = runner.model.layers[0].moe
    assert moe.weights["gate"].nbytes == 8 * 32 * 64 // 32 * 17  # the file's 17 bytes a block of 32
    got = greedy(runner, PROMPTS, NEW_TOKENS)
    same = sum(ids == ref_ids for (ids, _), (ref_ids, _) in zip(got, ref))
    first = torch.log_softmax(_prefill_and_decode(runner, PROMPTS)[0], dim=-1)
    worst = max(abs(row[t].item() - lp) for row, (_, tops) in zip(first, ref) for t, lp in tops[0].items())
    print(f"\n[figure] gpt-oss MXFP4 GGUF: greedy equal on {same}/16; first-step top-5 gap {worst:.2e}")
    assert same >= 15 and worst < QUANTIZED_GAP


def mxfp4_checkpoint(model_dir: Path, out: Path) -> Path:
    """The model as the published gpt-oss checkpoints store it: experts in MXFP4 `*_blocks` [E, rows,
    k / 32, 16] (adjacent values a byte, low nibble first) and e8m0 `*_scales` [E, rows, k / 32],
    rows the output features; quantized by the gguf package's MXFP4 (the same values and scales)."""
    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file, save_file

    out.mkdir()
    cfg = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).contiguous().numpy()  # [E, rows (outputs), k]
        raw = quants.quantize(w, GGMLQuantizationType.MXFP4).reshape(*w.shape[:2], -1, 17)
        scales, packed = raw[..., 0], raw[..., 1:]
        values = np.concatenate([packed & 15, packed >> 4], axis=-1)  # GGUF's: j low, j + 16 high
        tensors[name + "_blocks"] = torch.from_numpy(values[..., 0::2] | (values[..., 1::2] << 4))
        tensors[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_a_published_style_mxfp4_checkpoint_runs_as_stored_and_matches_transformers(model_dir, tmp_path):
    """Experts as the Hub's gpt-oss stores them: read in float, the model is transformers' on the
    blocks dequantized by transformers' own converter; run as stored (quantization "auto"), every
    expert weight the kernel computes with is that same dequantized value, at the file's bytes."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = mxfp4_checkpoint(model_dir, tmp_path / "mxfp4")
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text((model_dir / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    for name in [n.removesuffix("_blocks") for n in tensors if n.endswith("_blocks")]:
        blocks, scales = tensors.pop(name + "_blocks"), tensors.pop(name + "_scales")
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(ref_dir / "model.safetensors"))
    ref = _hf_greedy(_hf(ref_dir), PROMPTS, NEW_TOKENS)
    runner = ModelRunner(ckpt, quantization="none", num_blocks=256, block_size=8)
    got = greedy(runner, PROMPTS, NEW_TOKENS)
    same = sum(ids == ref_ids for (ids, _), (ref_ids, _) in zip(got, ref))
    first = torch.log_softmax(_prefill_and_decode(runner, PROMPTS)[0], dim=-1)
    worst = max(abs(row[t].item() - lp) for row, (_, tops) in zip(first, ref) for t, lp in tops[0].items())
    print(f"\n[figure] gpt-oss MXFP4 checkpoint in float: greedy equal on {same}/16; top-5 gap {worst:.2e}")
    assert same >= 15 and worst < 1e-3
    stored = ModelRunner(ckpt, num_blocks=64, block_size=8)  # quantization "auto": blocks as stored
    assert stored.model.linear_kinds()["layers.0.experts"] == f"mxfp4/{KERNELS.quant_path}"
    moe, fused = stored.model.layers[1].moe, tensors["model.layers.1.mlp.experts.gate_up_proj"]
    for e in (0, 5):
        gate = KERNELS.dequantize_rows(moe.weights["gate"], torch.arange(e * 32, e * 32 + 32))
        assert torch.equal(gate, fused[e][:, 0::2].T)
    assert moe.weights["gate"].nbytes == 8 * 32 * 64 // 32 * 17  # the checkpoint's 4.25 bits a weight
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        ModelConfig.from_hf({**json.loads((model_dir / "config.json").read_text()),
                             "quantization_config": {"quant_method": "gptq"}})


def test_a_gguf_with_a_misshaped_mxfp4_tensor_is_refused_naming_it(model_dir, tmp_path):
    gguf = write_gguf(model_dir, tmp_path / "broken.gguf", narrow="blk.1.ffn_up_exps.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up_exps\.weight"):
        ModelRunner(gguf, num_blocks=16, block_size=8)


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


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


@pytest.mark.parametrize("name, change", [
    ("model.layers.1.self_attn.sinks", None),  # missing
    ("model.layers.0.self_attn.sinks", torch.zeros(3)),  # the kernel would read 4
    ("model.layers.1.mlp.router.bias", torch.zeros(7)),
    ("model.layers.0.mlp.experts.down_proj_bias", torch.zeros(8, 63))])
def test_a_missing_or_misshaped_sink_or_bias_is_refused_naming_it(model_dir, tmp_path, name, change):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")
    if change is None:
        del tensors[name]
    else:
        tensors[name] = change
    save_file(tensors, broken / "model.safetensors")
    label = name.replace("experts.down_proj_bias", "experts.0.down_proj.bias").replace(".", r"\.")
    with pytest.raises(ValueError, match=label):
        ModelRunner(broken, quantization="none", num_blocks=16, block_size=8)
