"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE): tiny random models made with transformers,
read from their Hugging Face directories and from GGUF files written with `gguf`, against
transformers; the expert kernel's batch invariance on every path; the rest of the engine on a
MoE model; and every file or config it refuses, by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils import Blocks, _hf_greedy, greedy
from unison import Engine
from unison.model.families import ModelConfig
from unison.model.kernels import cpu_kernels
from unison.model.runner import BatchItem, ModelRunner
from unison.model.weights.gguf import GGUFWeights

KERNELS = cpu_kernels.load()
VOCAB = 49152  # the embedded tokenizer's, which the GGUFs carry: the engine tests send text
NEW_TOKENS = 8
QUANTIZED_GAP = 0.15  # tests/unit/test_quant.py's bound for quantized weights
# kind -> (transformers config class, its MoE options, GGUF architecture)
KINDS = {
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "head_dim": 32}, "qwen3moe"),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6},
                "llama"),
    "olmoe": ("OlmoeConfig", {"num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False}, "olmoe"),
}
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (3, 5, 8, 11, 13, 17, 19, 21, 24, 29, 31, 36, 40, 44, 51, 60)]


# ---- the models ----------------------------------------------------------------------------------

def tiny_moe(kind: str, path: Path) -> Path:
    """KINDS[kind], two layers of seeded random weights, saved by transformers in `path`."""
    import transformers

    name, extra, _ = KINDS[kind]
    torch.manual_seed(0)
    shape = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
             "bos_token_id": 1, "eos_token_id": 2}
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**(shape | extra)),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():  # random init is near-zero; widen it so positions, heads and routes matter
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    hf.save_pretrained(path)
    return path


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's q/k row order (llama only)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, kind: str, out: Path, qtype: str = "F32", drop: str | None = None,
               experts_in_metadata: int | None = None, extra: dict[str, np.ndarray] | None = None) -> Path:
    """The HF model in `model_dir` as llama.cpp's converter writes it: stacked experts, the router
    as ffn_gate_inp, linears and experts in `qtype` (F32, Q4_0, Q8_0), the embedded tokenizer.
    `drop`, `experts_in_metadata` and `extra` make broken files."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from unison.bench.model import copy_fields, embedded_tokenizer
    from unison.model.weights.sources import SafetensorsWeights

    cfg = json.loads((model_dir / "config.json").read_text())
    family, moe = ModelConfig.from_dir(model_dir).family, ModelConfig.from_dir(model_dir).moe
    src = SafetensorsWeights(model_dir)
    arch = KINDS[kind][2]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(out, arch)
    for key, value in [("block_count", cfg["num_hidden_layers"]), ("context_length", 512),
                       ("embedding_length", cfg["hidden_size"]),
                       ("feed_forward_length", cfg["intermediate_size"]),
                       ("head_count", heads), ("head_count_kv", kv_heads),
                       ("key_length", cfg.get("head_dim") or cfg["hidden_size"] // heads),
                       ("rope_freq_base", cfg["rope_parameters"]["rope_theta"]),
                       ("layer_norm_rms_eps", cfg["rms_norm_eps"]), ("vocab_size", VOCAB),
                       ("expert_count", experts_in_metadata or moe.num_experts),
                       ("expert_used_count", moe.top_k),
                       ("expert_feed_forward_length", moe.intermediate_size)]:
        getattr(w, f"add_{key}")(value)
    copy_fields(w, embedded_tokenizer())

    def add(name: str, t: np.ndarray, kind: str) -> None:
        if name == drop:
            return
        if kind == "F32" or t.ndim == 1:
            w.add_tensor(name, t.astype(np.float32))
        else:
            q = GGMLQuantizationType[kind]
            w.add_tensor(name, quants.quantize(t.astype(np.float32), q), raw_dtype=q)

    get = lambda name: src.float(name).numpy()  # noqa: E731
    add("token_embd.weight", get("model.embed_tokens.weight"), "Q8_0" if qtype != "F32" else "F32")
    add("output_norm.weight", get("model.norm.weight"), "F32")
    add("output.weight", get("lm_head.weight"), "Q8_0" if qtype != "F32" else "F32")
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", get(p + "input_layernorm.weight"), "F32")
        add(b + "ffn_norm.weight", get(p + "post_attention_layernorm.weight"), "F32")
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            t = get(p + f"self_attn.{h}_proj.weight")
            if arch == "llama" and g in "qk":
                t = _permute(t, heads if g == "q" else kv_heads)
            add(b + f"attn_{g}.weight", t, qtype)
        if family.qk_norm:
            add(b + "attn_q_norm.weight", get(p + "self_attn.q_norm.weight"), "F32")
            add(b + "attn_k_norm.weight", get(p + "self_attn.k_norm.weight"), "F32")
        add(b + "ffn_gate_inp.weight", get(family.moe.router_weight(i)), "F32")
        for proj in ("gate", "up", "down"):
            stacked = np.stack([get(family.moe.expert(i, e, proj)) for e in range(moe.num_experts)])
            add(b + f"ffn_{proj}_exps.weight", stacked, qtype)
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_dir(gguf: Path, model_dir: Path, out: Path) -> Path:
    """The GGUF's tensors dequantized by gguf's own code (as transformers' GGUF loader does), as
    an HF directory beside `model_dir`'s config: transformers' reference for the quantized file."""
    from safetensors.torch import save_file

    from unison.model.weights.gguf import hf_config, open_gguf

    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    weights = GGUFWeights(gguf, hf_config(open_gguf(gguf)))
    tensors = {n: weights.float(n).contiguous() for n in sorted(weights.names())}
    save_file(tensors, str(out / "model.safetensors"))
    return out


class _Models(dict):
    """(kind, form) -> a model path, made on first use: form "hf", "f32" (a float GGUF), "q4"
    (Q4_0 linears and experts) or "q4-ref" (the Q4_0 file dequantized, as an HF directory)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, key: tuple[str, str]) -> Path:
        kind, form = key
        if form == "hf":
            path = tiny_moe(kind, self.root / kind)
        elif form == "q4-ref":
            path = dequantized_dir(self[kind, "q4"], self[kind, "hf"], self.root / f"{kind}-q4-ref")
        else:
            qtype = "F32" if form == "f32" else "Q4_0"
            path = write_gguf(self[kind, "hf"], kind, self.root / f"{kind}-{form}.gguf", qtype)
        self[key] = path
        return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> _Models:
    return _Models(tmp_path_factory.mktemp("moe"))


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ---- parity ------------------------------------------------------------------------------------

# (form of Unison's model, quantization, transformers' model, first-step bound)
PARITY = {"hf-float": ("hf", "none", "hf", 1e-3), "gguf-float": ("f32", "none", "hf", 1e-3),
          "gguf-int4": ("q4", "auto", "q4-ref", QUANTIZED_GAP)}


@pytest.mark.parametrize("case", PARITY)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers(models, kind: str, case: str):
    """16 prompts together, 8 greedy tokens: equal to transformers on at least 15; first-step
    top-5 logprobs within 1e-3 in float32, within the quantized bound on the file's Q4_0 blocks
    (against the same blocks dequantized)."""
    form, quantization, ref_form, bound = PARITY[case]
    ref = _hf_greedy(_hf(models[kind, ref_form]), PROMPTS, NEW_TOKENS)
    runner = ModelRunner(models[kind, form], quantization=quantization, num_blocks=128, block_size=8)
    assert runner.config.moe is not None and runner.config.family.name == kind
    expected = "float32" if quantization == "none" else f"int4/{KERNELS.quant_path}"
    assert runner.model.linear_kinds()["layers.1.experts"] == expected
    got = greedy(runner, PROMPTS, NEW_TOKENS)
    same = sum(ids == ref_ids for (ids, _), (ref_ids, _) in zip(got, ref))
    first = torch.log_softmax(_prefill_and_decode(runner, PROMPTS)[0], dim=-1)
    worst = max(abs(row[t].item() - lp)
                for row, (_, ref_tops) in zip(first, ref) for t, lp in ref_tops[0].items())
    print(f"\n[figure] {kind} {case}: greedy equal on {same}/16; first-step top-5 logprob gap {worst:.2e}")
    assert same >= 15 and worst < bound


def test_router_and_experts_as_transformers_compute_them(models):
    """One MoE block alone: the kernel's experts and weights are transformers' on 64 rows, and its
    output is transformers' block output on the same (dequantized) weights."""
    runner = ModelRunner(models["qwen3_moe", "q4"], num_blocks=8)
    block = _hf(models["qwen3_moe", "q4-ref"]).model.layers[0].mlp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    top, weight = runner.model.layers[0].moe.route(x)
    with torch.no_grad():
        _, ref_weight, ref_top = block.gate(x)  # transformers 5: (logits, top-k weights, experts)
        want = block(x[None])[0]
    order = ref_top.sort(-1)  # the kernel lists a row's experts in increasing order
    assert torch.equal(top, order.values)
    torch.testing.assert_close(weight, ref_weight.gather(-1, order.indices), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runner.model.layers[0].moe(x), want, rtol=0, atol=2e-3)


# ---- batch invariance, paths, the compiled forward ----------------------------------------------

def _prefill_and_decode(runner: ModelRunner, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = Blocks(runner)
    tables = [blocks.table(len(p) + 1) for p in prompts]
    first = runner.forward([BatchItem(p, 0, t, len(p) - 1) for p, t in zip(prompts, tables)])
    nxt = runner.forward([BatchItem([int(r.argmax())], len(p), t, 0)
                          for p, t, r in zip(prompts, tables, first)])
    return first, nxt


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_bit_identical_alone_or_together(models, kind: str):
    runner = ModelRunner(models[kind, "q4"], num_blocks=256, block_size=8)
    together = _prefill_and_decode(runner, PROMPTS)
    for i, p in enumerate(PROMPTS):
        alone = _prefill_and_decode(runner, [p])
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i]), i


def test_compiled_forward_and_every_path_give_the_same_bits(models, monkeypatch):
    runner = ModelRunner(models["qwen3_moe", "q4"], num_blocks=256, block_size=8)
    assert runner._compiled is not None
    want = _prefill_and_decode(runner, PROMPTS)
    before = KERNELS.quant_path
    try:
        for path in KERNELS.supported_quant_paths():
            KERNELS.select_quant_path(path)
            got = _prefill_and_decode(runner, PROMPTS)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), path
    finally:
        KERNELS.select_quant_path(before)
    monkeypatch.setattr(runner, "_compiled", None)  # the Python forward, kernel by kernel
    got = _prefill_and_decode(runner, PROMPTS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_experts_stay_in_their_blocks(models):
    """The Q4_0 experts run in the file's own 4.5 bits a weight (144-byte records: m = -8 d is
    computed by the kernel), no float copy: the experts as executed are the file's bytes."""
    from unison.model.weights.gguf import open_gguf

    path = models["olmoe", "q4"]
    runner = ModelRunner(path, num_blocks=8)
    moe = runner.model.layers[0].moe
    assert all(w.packed.dtype == torch.uint8 and w.format == 144 for w in moe.weights.values())
    in_file = sum(t.dims[0] * t.dims[1] * t.dims[2] * 18 // 32 for t in open_gguf(path).tensors
                  if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight"))
    assert sum(w.nbytes for w in moe.weights.values()) == in_file


# ---- the rest of the engine ---------------------------------------------------------------------

def test_engine_features_on_a_moe_model(models):
    """Chunked prefill and ngram speculation give plain decoding's tokens; a repeated prompt hits
    the prefix cache with the same output; structured output holds; an attention-only LoRA
    adapter runs."""
    from tests.adapters import make_adapter

    path = str(models["qwen3_moe", "q4"])
    adapter = make_adapter(models.root / "lora-q-v", targets=("q_proj", "v_proj"), rank=4, seed=1,
                           model_dir=models["qwen3_moe", "hf"])
    texts = ["the quick brown fox jumps over the lazy dog " * 6, "one two three four five six " * 8]
    greedy_params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(model_path=path, num_threads=1, max_total_tokens=4096, chunked_prefill_size=16,
                enable_lora=True, lora_paths=[f"qv={adapter}"]) as engine:
        chunked = [o["output_ids"] for o in engine.generate(texts, greedy_params)]
        again = engine.generate(texts[0], greedy_params)
        assert again["output_ids"] == chunked[0] and again["meta_info"]["cached_tokens"] > 0
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        out = engine.generate("json:", {"temperature": 0, "max_new_tokens": 24,
                                        "json_schema": json.dumps(schema)})
        assert isinstance(json.loads(out["text"])["n"], int)
        adapted = engine.generate(texts[0], greedy_params, lora_path="qv")
        assert adapted["meta_info"]["completion_tokens"] == 12
        info = engine.get_server_info()
        assert info["weights"]["layers.0.experts"].startswith("int4")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    with Engine(model_path=path, num_threads=1, max_total_tokens=4096, speculative_config=spec) as engine:
        assert [o["output_ids"] for o in engine.generate(texts, greedy_params)] == chunked


# ---- refusals ------------------------------------------------------------------------------------

def test_broken_gguf_files_are_refused_naming_the_tensor(models, tmp_path: Path):
    hf = models["mixtral", "hf"]
    cases = {
        "missing": ({"drop": "blk.1.ffn_up_exps.weight"}, "blk.1.ffn_up_exps.weight"),
        "count": ({"experts_in_metadata": 6}, "blk.0.ffn_gate_inp.weight"),
        "shared": ({"extra": {"blk.0.ffn_gate_shexp.weight": np.zeros((32, 64), np.float32)}},
                   "shared experts"),
    }  # (MXFP4 experts run as stored: tests/e2e/test_gpt_oss.py)
    for name, (opts, match) in cases.items():
        path = write_gguf(hf, "mixtral", tmp_path / f"{name}.gguf", **opts)
        with pytest.raises(ValueError, match=match.replace(".", r"\.")):
            ModelRunner(path, num_blocks=8)


@pytest.mark.parametrize("change, match", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "DeepseekV3ForCausalLM"),
])
def test_variants_it_does_not_run_are_refused_by_name(models, tmp_path: Path, change: dict, match: str):
    cfg = json.loads((models["qwen3_moe", "hf"] / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dir(tmp_path)


def test_lora_on_the_experts_is_refused_by_name(models, tmp_path: Path):
    from tests.adapters import make_adapter
    from unison.model.layers.lora import read_peft

    cfg = ModelConfig.from_dir(models["olmoe", "hf"])
    adapter = make_adapter(tmp_path / "a", targets=("q_proj",), rank=4, model_dir=models["olmoe", "hf"])
    assert read_peft(adapter, cfg, 16).targets == ("q_proj",)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "gate_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mixture of experts"):
        read_peft(adapter, cfg, 16)
