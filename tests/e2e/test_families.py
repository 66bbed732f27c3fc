"""Families beyond Llama: the real Gemma 3 file against transformers, the prefix cache across a
sliding window, GGUF rope_freqs, prompts tokenized as AutoTokenizer does, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils import Blocks, assert_greedy_close, greedy, hf_reference, on_test_device
from unison import Engine
from unison.frontend.text.tokenizer import Tokenizer
from unison.model.runner import BatchItem, ModelRunner
from unison.model.weights.loader import resolve_model_dir

NEW_TOKENS = 24
QUANTIZED_GAP = 0.15  # tests/unit/test_quant.py's bound for quantized weights against float32
LONG = ("The history of the printing press begins in the fifteenth century, when movable type "
        "changed how books were made, sold and read across Europe. ") * 30  # > 600 tokens
GEMMA_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<bos>A prompt that already starts with its BOS",  # as transformers: a second one is added
    LONG + "In short, the printing press",
]


CLI_PROMPT, CLI_TOKENS = GEMMA_TEXTS[0], 12


def hf_references() -> list[tuple[Path | None, list[list[int]], int]]:
    """The transformers references this module asks for: (GGUF, prompts, tokens) for
    hf_reference (tests/references.py computes them ahead of the tests, in the background)."""
    from tests.models import gemma3_gguf

    path = gemma3_gguf()
    tok = Tokenizer.from_dir(resolve_model_dir(path))
    return [(path, [tok.encode(t) for t in GEMMA_TEXTS], NEW_TOKENS),
            (path, [tok.encode(CLI_PROMPT)], CLI_TOKENS)]


@pytest.fixture(scope="module")
def gemma_tok(gemma3_path: Path) -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_dir(gemma3_path))


@pytest.fixture(scope="module")
def gemma_prompts(gemma_tok: Tokenizer) -> list[list[int]]:
    return [gemma_tok.encode(t) for t in GEMMA_TEXTS]


@pytest.fixture(scope="module")
def gemma_reference(gemma3_path, gemma_prompts):
    """transformers on the same GGUF, float32: loaded (about 60 s) and run once per machine."""
    return hf_reference(gemma_prompts, NEW_TOKENS, gemma3_path)


def test_gemma_prompts_tokenize_as_autotokenizer(gemma3_path, gemma_prompts):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(resolve_model_dir(gemma3_path))
    assert len(gemma_prompts[-1]) > 600  # crosses the 512-token window
    for text, ids in zip(GEMMA_TEXTS, gemma_prompts):
        assert ids == hf(text)["input_ids"], text[:40]
    assert gemma_prompts[0][0] == 2 and gemma_prompts[6][:2] == [2, 2]


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_gemma_matches_transformers(gemma3_path, gemma_prompts, gemma_reference, quantization):
    """8 prompts, one past the window, x 24 greedy tokens; first-step logprobs within 1e-3 in
    float32, within the quantized bound for the file's own blocks."""
    runner = ModelRunner(gemma3_path, quantization=quantization, num_blocks=160, **on_test_device())
    cfg = runner.config
    assert cfg.layer_window.count(512) == 15 and cfg.layer_window.count(None) == 3
    got = greedy(runner, gemma_prompts, NEW_TOKENS)
    gap = 0.1 if quantization == "none" else QUANTIZED_GAP
    for text, (ref_ids, ref_top), (ids, tops) in zip(GEMMA_TEXTS, gemma_reference, got):
        assert_greedy_close(ref_ids, ref_top, ids, tops, name=text[:30], max_gap=gap)
    blocks, worst = Blocks(runner), 0.0
    for prompt, (_, ref_top) in zip(gemma_prompts, gemma_reference):
        logits = runner.forward([BatchItem(prompt, 0, blocks.table(len(prompt)), len(prompt) - 1)])
        logprobs = torch.log_softmax(logits[0], dim=-1)
        worst = max(worst, *(abs(logprobs[t].item() - lp) for t, lp in ref_top[0].items()))
    print(f"\n[figure] Gemma 3 ({runner.quantization}): largest first-step top-5 logprob "
          f"difference from transformers: {worst:.5f}")
    assert worst < (1e-3 if quantization == "none" else QUANTIZED_GAP)


def test_gemma_cli_prints_what_transformers_prints(gemma3_path, gemma_tok):
    prompt = CLI_PROMPT
    [(ref_ids, _)] = hf_reference([gemma_tok.encode(prompt)], CLI_TOKENS, gemma3_path)
    out = subprocess.run([sys.executable, "-m", "unison.cli", "generate", prompt, "--model-path",
                          str(gemma3_path), "--max-new-tokens", str(CLI_TOKENS), "--temperature", "0",
                          "--quantization", "none"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.rstrip("\n") == gemma_tok.decode(ref_ids)


def test_gemma_prefix_cache_hit_past_the_window_equals_a_cold_run(gemma3_path, gemma_tok):
    """Windowed layers keep every block (none is freed), so a hit may start anywhere; the paged
    attention computes each row alike whatever is cached: identical tokens and logprobs."""
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    prompt = gemma_tok.encode(LONG)[:700]
    with Engine(model_path=str(gemma3_path), max_total_tokens=4096) as engine:
        def run(ids):
            return engine.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                                   top_logprobs_num=5)
        cold = run(prompt)
        hit = run(prompt[:-1] + [prompt[-1] + 1])  # a different last token: a 688-token hit
        again = run(prompt)
        assert hit["meta_info"]["cached_tokens"] >= 640 and again["meta_info"]["cached_tokens"] >= 688
        assert engine.flush_cache()
        cold_again = run(prompt)
        text = engine.generate(GEMMA_TEXTS[0], {"max_new_tokens": 1}, return_logprob=True,
                               logprob_start_len=0)
    for out in (again, cold_again):
        assert out["output_ids"] == cold["output_ids"]
        assert out["meta_info"]["output_top_logprobs"] == cold["meta_info"]["output_top_logprobs"]
    assert text["meta_info"]["input_token_logprobs"][0][1] == 2  # a plain prompt gets its BOS


# ---- rope ---------------------------------------------------------------------------------------

def test_gguf_rope_freqs_match_transformers_llama3(tmp_path: Path):
    """Llama 3.1+ GGUFs carry llama3 rope scaling as a rope_freqs tensor of per-frequency
    divisors (llama.cpp's converter computes them): read back, the model is transformers'."""
    import transformers
    from gguf import GGUFWriter

    from unison.model.weights.gguf import write_config

    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_parameters=rope)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path, "llama")
    for key, value in [("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", 4), ("head_count_kv", 2),
                       ("vocab_size", 256), ("rope_freq_base", 500000.0), ("layer_norm_rms_eps", 1e-6)]:
        getattr(w, f"add_{key}")(value)
    w.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(16, rope))
    for name, t in _llama_gguf_tensors(hf).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model_dir = tmp_path / "config"
    model_dir.mkdir()
    assert "rope_scaling" not in write_config(path, model_dir)  # only the factors carry it

    ids = torch.randint(0, 256, (40,)).tolist()  # past the 16 original positions
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(path, model_dir=model_dir, quantization="none", num_blocks=8, block_size=8,
                         **on_test_device())
    got = runner.forward([BatchItem(ids, 0, list(range(5)), 0)])
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=3e-4)


def _llama_cpp_rope_factors(head_dim: int, s: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, for llama3 scaling."""
    import math

    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old, factor = s["original_max_position_embeddings"], s["factor"]
    low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama_gguf_tensors(hf) -> dict[str, np.ndarray]:
    """An HF Llama's tensors under GGUF names, q/k rows permuted as llama.cpp's converter does."""
    cfg = hf.config
    out = {}
    renames = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}
    for name, t in hf.state_dict().items():
        t = t.numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif name == "model.norm.weight":
            out["output_norm.weight"] = t
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = t
        else:
            _, _, i, *rest = name.split(".")
            part = ".".join(rest[:-1])
            if part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in part else cfg.num_key_value_heads
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
            out[f"blk.{i}.{renames[part]}.weight"] = t
    return out


# ---- tokens as the reference adds them ------------------------------------------------------

def _synthetic_tokenizer(tmp_path: Path, src: Path, style: str) -> Path:
    """SmolLM2's vocabulary with a Llama 3 style post-processor (a TemplateProcessing BOS), or
    with add_bos_token in tokenizer_config.json only (as Llama 2 and Gemma repositories carry)."""
    d = tmp_path / style
    d.mkdir()
    tj = json.loads((src / "tokenizer.json").read_text())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    if style == "template_bos":
        tj["post_processor"] = {
            "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                "tokens": ["<|im_start|>"]}}}
        cfg["chat_template"] = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    else:
        cfg["add_bos_token"] = True
    (d / "tokenizer.json").write_text(json.dumps(tj))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_prompts_get_special_tokens_as_autotokenizer_adds_them(tmp_path, model_dir, gemma3_path):
    from transformers import AutoTokenizer

    dirs = {"smollm2": model_dir, "gemma3": resolve_model_dir(gemma3_path),
            **{s: _synthetic_tokenizer(tmp_path, model_dir, s) for s in ("template_bos", "config_bos")}}
    texts = ["Hello world", "<|im_start|>already there", "<bos> and <s>", " leading space", "日本語"]
    for name, d in dirs.items():
        ours, hf = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
        for text in texts:
            assert ours.encode(text) == hf(text)["input_ids"], (name, text)
            bare = hf(text, add_special_tokens=False)["input_ids"]
            assert ours.encode(text, add_special_tokens=False) == bare, (name, text)
    assert Tokenizer.from_dir(dirs["template_bos"]).encode("Hi")[0] == 1

    # A chat template that writes its own BOS, encoded without special tokens: one BOS, as HF.
    ours, hf = Tokenizer.from_dir(dirs["template_bos"]), AutoTokenizer.from_pretrained(dirs["template_bos"])
    chat = [{"role": "user", "content": "Hi"}]
    ids = ours.encode(ours.apply_chat_template(chat), add_special_tokens=False)
    assert ids == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids.count(1) == 1


def test_token_id_prompts_are_never_changed(model_dir):
    ids = [1, 1, 19556, 905]
    with Engine(model_path=None, quantization="none", max_total_tokens=2048) as engine:
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                              logprob_start_len=0)
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == ids


# ---- families we don't run ----------------------------------------------------------------------

def test_an_unsupported_family_is_a_clear_error_in_under_2_s(tmp_path: Path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(path, "gpt2")
    w.add_token_list([f"tok{i}" for i in range(200_000)])  # a big vocabulary: never converted
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'; supported: .*'gemma3'"):
        resolve_model_dir(path)
    assert time.perf_counter() - t0 < 2.0
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: .*Gemma3ForCausalLM"):
        resolve_model_dir(tmp_path / "hf")
