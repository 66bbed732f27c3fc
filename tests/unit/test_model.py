"""The model against transformers: GGUF conversion, greedy parity, batching, loader errors."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils import (
    TEST_DEVICE,
    TEXTS,
    Blocks,
    assert_greedy_close,
    greedy,
    hf_reference,
    hf_state_dict,
    on_test_device,
)
from unison.model.decoder import TorchOps
from unison.model.layers import attention as attention_module
from unison.model.runner import BatchItem, ModelRunner
from unison.model.weights import loader
from unison.model.weights.gguf import GGUFWeights
from unison.model.weights.loader import default_gguf_path, resolve_model_dir

NEW_TOKENS = 32
# Logits (magnitude ~20) of the same tokens computed in batches of different shapes: the GEMMs
# round differently, by up to ~1.5e-4 here; a real bug (mask, position, slot) is off by >0.01.
LOGITS_TOL = {"rtol": 1e-4, "atol": 3e-4}
CHATS = [
    "What is the capital of Japan?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence why the sky is blue.",
]


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                     add_generation_prompt=True) for c in CHATS]
    return [tok(text, add_special_tokens=False)["input_ids"] for text in TEXTS + chats]


def hf_references() -> list[tuple[Path | None, list[list[int]], int]]:
    """The transformers references this module asks for: (GGUF, prompts, tokens) for
    hf_reference (tests/references.py computes them ahead of the tests, in the background)."""
    return [(None, prompt_ids(resolve_model_dir(None)), NEW_TOKENS)]


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return prompt_ids(model_dir)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    runner = ModelRunner(None, quantization="none", num_blocks=128, **on_test_device())
    runner.warmup()
    return runner


@pytest.fixture(scope="module")
def torch_runner() -> ModelRunner:
    """The reference path: torch ops only (what runs without a C compiler, or off CPU)."""
    runner = ModelRunner(None, quantization="none", num_blocks=128, **on_test_device())
    runner.model.ops, runner._kernel = TorchOps(), None
    runner.warmup()
    return runner


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    return hf_reference(prompts, NEW_TOKENS)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.cpu(), want.cpu(), **LOGITS_TOL, msg=lambda m: f"{what}: {m}")


def test_parity_runs_on_the_test_device(runner: ModelRunner, prompts):
    """UNISON_TEST_DEVICE=cuda puts the weights, the KV cache and the forward on the GPU (torch
    ops: the C kernels are the CPU's); the default is the CPU."""
    device = torch.device(TEST_DEVICE).type
    model = runner.model
    linears = [model.lm_head] + [lin for layer in model.layers for lin in (layer.qkv, layer.down)]
    weights = [model.embed.table, model.norm] + [layer.input_norm for layer in model.layers]
    weights += [lin.weight if lin.packed is None else lin.packed for lin in linears]  # oneDNN's, on CPU
    assert {t.device.type for t in weights} == {device} and runner.attention.k_cache.device.type == device
    assert runner.dtype == torch.float32 and {t.dtype for t in weights} == {torch.float32}
    logits = runner.forward([BatchItem(prompts[0], 0, Blocks(runner).table(len(prompts[0])), 0)])
    assert logits.device.type == device
    if device != "cpu":
        assert runner._kernel is None and isinstance(model.ops, TorchOps)


def test_gguf_tensors_equal_transformers_gguf_loader(model_dir: Path):
    """Read in place from the GGUF, dequantized: the tensors transformers' own loader builds."""
    weights = GGUFWeights(default_gguf_path())
    theirs = hf_state_dict()
    assert weights.names() == set(theirs) - {"lm_head.weight"}  # tied: transformers lists it anyway
    for name in weights.names():
        tensor = weights.float(name)
        assert tensor.dtype == torch.float32
        if tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]):
            continue  # bit for bit, so within any tolerance: a memcmp, not assert_close's passes
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        assert (model_dir / f).is_file(), f
    assert not list(model_dir.glob("*.safetensors")), "the cache holds no weights: they stay in the GGUF"


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_greedy_matches_transformers(runner: ModelRunner, torch_runner: ModelRunner, path: str, prompts,
                                     reference):
    if path == "kernels" and runner._kernel is None:
        pytest.skip("no C compiler here: the runner uses torch ops")
    got = greedy(runner if path == "kernels" else torch_runner, prompts, NEW_TOKENS)
    for i, ((ref_ids, ref_top), (got_ids, got_top)) in enumerate(zip(reference, got)):
        assert_greedy_close(ref_ids, ref_top, got_ids, got_top, name=f"prompt {i}")


def test_first_step_logprobs_match_transformers(runner: ModelRunner, prompts, reference):
    blocks = Blocks(runner)
    for prompt, (_, ref_top) in zip(prompts, reference):
        logits = runner.forward([BatchItem(prompt, 0, blocks.table(len(prompt)), len(prompt) - 1)])
        logprobs = torch.log_softmax(logits[0], dim=-1)
        for token, ref in ref_top[0].items():
            assert abs(logprobs[token].item() - ref) < 1e-3, (token, logprobs[token].item(), ref)


def test_chunked_batched_forward_equals_alone(runner: ModelRunner, prompts):
    """Staggered requests, prompts prefilled 16 tokens at a time beside other requests' decodes,
    give the logits each request gets alone in one forward (teacher-forced, all positions)."""
    seqs = [p + [42, 17, 1000, 7, 99] for p in prompts[:2] + prompts[4:]]
    blocks = Blocks(runner)
    alone = [runner.forward([BatchItem(s, 0, blocks.table(len(s)), 0)]) for s in seqs]

    tables = [blocks.table(len(s)) for s in seqs]
    prompt_lens = [len(s) - 5 for s in seqs]
    done, got = [0] * len(seqs), [[] for _ in seqs]
    for step in range(200):
        batch, owners = [], []
        for i, s in enumerate(seqs):
            if step < i or done[i] == len(s):  # request i arrives at step i
                continue
            n = min(16, prompt_lens[i] - done[i]) if done[i] < prompt_lens[i] else 1
            # odd requests want prompt logprobs (all rows); even ones only the last row
            logits_start = 0 if i % 2 else n - 1
            batch.append(BatchItem(s[done[i]: done[i] + n], done[i], tables[i], logits_start))
            owners.append((i, done[i] + logits_start, n - logits_start))
            done[i] += n
        if not batch:
            break
        logits = runner.forward(batch)
        assert logits.shape[0] == sum(n for *_, n in owners)
        for (i, first, _), rows in zip(owners, logits.split([n for *_, n in owners])):
            got[i].append((first, rows))
    for i, s in enumerate(seqs):
        for first, rows in got[i]:
            assert_logits_close(rows, alone[i][first: first + len(rows)],
                                f"request {i} from position {first}")
        assert got[i][-1][0] + len(got[i][-1][1]) == len(s)


@pytest.mark.parametrize("path", ["kernel", "torch", "torch-chunked"])
def test_decode_of_mixed_lengths_equals_alone(runner: ModelRunner, prompts, path, monkeypatch):
    """Decodes over very different context lengths in one step, and decodes of one length group:
    through the C kernel, and through torch's path (padded in separate groups; split into chunks
    of one request each)."""
    if path == "kernel" and runner._kernel is None:
        pytest.skip("no C compiler here: the runner uses torch's path")
    if path != "kernel":
        monkeypatch.setattr(runner, "_kernel", None)
    if path == "torch-chunked":
        monkeypatch.setattr(attention_module, "DECODE_CHUNK_BYTES", 1)
    long = [t for p in prompts for t in p] * 3
    seqs = [prompts[0][:3], long[:300], prompts[1], long[:560], long[5:9]]
    blocks = Blocks(runner)
    tables = [blocks.table(len(s) + 1) for s in seqs]
    for s, t in zip(seqs, tables):
        runner.forward([BatchItem(s, 0, t, len(s))])
    batch = [BatchItem([42 + i], len(s), t, 0) for i, (s, t) in enumerate(zip(seqs, tables))]
    for items in (batch, [batch[0], batch[2], batch[4]]):
        together = runner.forward(items)
        for i, b in enumerate(items):
            assert_logits_close(together[i: i + 1], runner.forward([b]), f"request {i}")


def test_logits_only_where_asked(runner: ModelRunner, prompts):
    blocks = Blocks(runner)
    p = prompts[0]
    none = runner.forward([BatchItem(p, 0, blocks.table(len(p)), len(p))])
    assert none.shape == (0, runner.vocab_size)


TINY = {  # small random models of each supported kind, saved by transformers
    "llama-llama3-rope-untied": ("LlamaConfig", {"tie_word_embeddings": False, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama-linear-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 8}),
    "qwen2-qkv-bias": ("Qwen2Config", {}),
    "qwen2-yarn-rope": ("Qwen2Config", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}}),
    "qwen3-qk-norm": ("Qwen3Config", {"head_dim": 32}),
    # Gemma 3: layers 0-4 windowed (window 3, under the block size) with their own rope theta,
    # layer 5 global; sandwich norms stored as w for (1 + w), GELU, scaled embeddings.
    "gemma3-window-under-a-block": ("Gemma3TextConfig", {
        "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 3, "query_pre_attn_scalar": 24}),
    "gemma3-window-across-chunks": ("Gemma3TextConfig", {
        "num_hidden_layers": 6, "sliding_window": 7, "query_pre_attn_scalar": 16}),
    "olmo2-post-norms": ("Olmo2Config", {}),
}


def tiny_model(kind: str, path: Path, **changes):
    """TINY[kind] (with `changes` to its config) with seeded random weights, saved by
    transformers in `path`; returns the model."""
    import transformers

    name, extra = TINY[kind]
    torch.manual_seed(0)
    shape = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    cfg = getattr(transformers, name)(**(shape | extra | changes))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random init is near-zero; widen it so positions and heads matter
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("kind", TINY)
def test_architectures_match_transformers(kind: str, path: str, tmp_path: Path):
    """Each architecture, prefilled in chunks of 5 (across any window's edge) then decoded token
    by token, gives transformers' logits at every position; through the C kernels and torch."""
    hf = tiny_model(kind, tmp_path)
    ids = torch.randint(0, 256, (24,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]

    runner = ModelRunner(tmp_path, num_blocks=8, block_size=4, **on_test_device())
    if path == "torch":
        if runner._kernel is None:
            pytest.skip("no C compiler here: the kernels path is the torch path")
        runner.model.ops, runner._kernel = TorchOps(), None
    table = [5, 2, 7, 0, 3, 1]  # scattered blocks, 4 tokens each
    got = [runner.forward([BatchItem(ids[i: i + 5], i, table, 0)]) for i in range(0, 10, 5)]
    got += [runner.forward([BatchItem([t], 10 + i, table, 0)]) for i, t in enumerate(ids[10:])]
    assert_logits_close(torch.cat(got), ref, kind)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_tensors_map_to_hf(arch: str, tmp_path: Path):
    """A GGUF written as llama.cpp writes one (q/k rows permuted for llama only) converts back to
    the original tensors under their Hugging Face names."""
    import numpy as np
    from gguf import GGUFWriter

    from unison.model.weights.gguf import hf_config, open_gguf

    rng = np.random.default_rng(0)
    hf = {"model.embed_tokens.weight": (32, 8), "model.norm.weight": (8,),
          "lm_head.weight": (32, 8)}
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
             "model.norm.weight", "output.weight": "lm_head.weight"}
    layer = {"attn_norm.weight": ("input_layernorm.weight", (8,)),
             "attn_q.weight": ("self_attn.q_proj.weight", (8, 8)),
             "attn_k.weight": ("self_attn.k_proj.weight", (4, 8)),
             "attn_v.weight": ("self_attn.v_proj.weight", (4, 8)),
             "attn_output.weight": ("self_attn.o_proj.weight", (8, 8)),
             "ffn_norm.weight": ("post_attention_layernorm.weight", (8,)),
             "ffn_gate.weight": ("mlp.gate_proj.weight", (16, 8)),
             "ffn_up.weight": ("mlp.up_proj.weight", (16, 8)),
             "ffn_down.weight": ("mlp.down_proj.weight", (8, 16))}
    layer |= {"qwen2": {f"attn_{x}.bias": (f"self_attn.{x}_proj.bias", (8 if x == "q" else 4,))
                        for x in "qkv"},
              "qwen3": {f"attn_{x}_norm.weight": (f"self_attn.{x}_norm.weight", (4,))
                        for x in "qk"},
              }.get(arch, {})
    for g, (h, shape) in layer.items():
        names[f"blk.0.{g}"] = f"model.layers.0.{h}"
        hf[f"model.layers.0.{h}"] = shape
    tensors = {h: rng.standard_normal(shape).astype(np.float32) for h, shape in hf.items()}

    def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
            w.shape)

    w = GGUFWriter(tmp_path / "m.gguf", arch)
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 1),
                       ("vocab_size", 32), ("rope_freq_base", 1e6), ("layer_norm_rms_eps", 1e-6),
                       ("bos_token_id", 1), ("eos_token_id", 2)]:
        getattr(w, f"add_{key}")(value)
    for g, h in names.items():
        t = tensors[h]
        if arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
            t = llama_cpp_permute(t, 2 if "attn_q" in g else 1)
        w.add_tensor(g, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    config = hf_config(open_gguf(tmp_path / "m.gguf"))
    assert config["model_type"] == arch and not config["tie_word_embeddings"]
    heads = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    assert heads == (2, 1, 4)
    weights = GGUFWeights(tmp_path / "m.gguf", config)
    assert weights.names() == set(tensors)
    for h, t in tensors.items():
        np.testing.assert_array_equal(weights.float(h).numpy(), t, err_msg=h)


# --- loader ------------------------------------------------------------------------------


def test_resolve_cached_is_fast_and_stable(model_dir: Path):
    t = time.perf_counter()
    assert resolve_model_dir(None) == model_dir
    assert time.perf_counter() - t < 2.0
    assert resolve_model_dir(str(model_dir)) == model_dir  # a directory is used as is
    # no temp dirs of this model's (other tests' conversions may be in flight beside it)
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith("." + model_dir.name[:16])]


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="/no/such/model.gguf"):
        resolve_model_dir("/no/such/model.gguf")


def split_gguf(src: Path, out: Path, max_tensors: int) -> Path:
    """`src` written again as llama-gguf-split writes it: parts of at most `max_tensors` tensors,
    the metadata in the first. Returns the first part."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out / "model.gguf", arch, split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return min(out.glob("model-00001-of-*.gguf"))


def test_a_split_gguf_reads_as_the_whole_file(tmp_path: Path, monkeypatch):
    """A model downloaded in parts (the Hub's big GGUFs): the first part names them all; every
    tensor is the whole file's, byte for byte. A later part, or a missing one, is refused by name."""
    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "cache"))
    whole = default_gguf_path()
    first = split_gguf(whole, tmp_path, max_tensors=100)
    parts = sorted(tmp_path.glob("model-0000*-of-*.gguf"))
    assert len(parts) >= 2 and parts[0] == first
    a, b = GGUFWeights(whole), GGUFWeights(first)
    assert a.tensors.keys() == b.tensors.keys()
    assert {t.part for t in b.tensors.values()} == set(range(len(parts)))  # every part holds some
    assert all(np.array_equal(a.tensors[k].data, b.tensors[k].data) for k in a.tensors)
    assert json.loads((resolve_model_dir(first) / "config.json").read_text())["num_hidden_layers"] == 30
    with pytest.raises(ValueError, match=r"model-00002-of-0000\d.gguf is part 2 of a split GGUF: name its "
                                         r"first part \(model-00001-of-0000\d.gguf\)"):
        GGUFWeights(parts[1])
    parts[-1].unlink()
    with pytest.raises(FileNotFoundError, match=r"the split GGUF's parts \['model-0000\d-of-0000\d.gguf'\] "
                                                r"are not beside it"):
        GGUFWeights(first)


def test_not_a_gguf_file(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_text("hello, not a model")
    with pytest.raises(ValueError, match="model.gguf"):
        resolve_model_dir(bad)


def test_corrupt_gguf(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="broken.gguf"):
        resolve_model_dir(bad)
    assert not list((tmp_path / "cache").rglob("config.json"))


def test_unsupported_architecture(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        resolve_model_dir(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelRunner(tmp_path, num_blocks=4)


def test_missing_and_corrupt_weights(tmp_path: Path, model_dir: Path):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(tmp_path, num_blocks=4)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        ModelRunner(tmp_path, num_blocks=4)


def test_concurrent_conversion_runs_once(tmp_path: Path, monkeypatch):
    """Racing resolvers convert once; each sees only the complete, published directory."""
    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 64)
    calls = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.3)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr("unison.model.weights.gguf.convert_gguf", fake_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(loader.resolve_model_dir(src)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert (results[0] / "config.json").is_file() and results[0].parent.parent == tmp_path / "cache"


def test_header_fields_are_the_gguf_packages_own():
    """Our header reader (torch-free, 60x faster on a 262k vocabulary) reads every field as the gguf
    package does: keys in order, types, and whole values, arrays included."""
    import gguf

    from unison.model.weights.gguf_header import read_fields

    path = default_gguf_path()
    theirs = {k: f for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    ours = read_fields(path)
    assert list(ours) == list(theirs)
    for key, field in theirs.items():
        elem_type = field.types[1] if len(field.types) > 1 else None
        assert (ours[key].kind, ours[key].elem_type) == (field.types[0], elem_type), key
        assert ours[key].value == field.contents(), key
    assert list(read_fields(path, "tokenizer.")) == [k for k in ours if k.startswith("tokenizer.")]


def test_a_tokenizer_is_converted_once_for_the_files_that_share_it(tmp_path: Path, monkeypatch):
    """Files whose weights differ (two quantizations of one model) convert their tokenizer once; a
    file whose vocabulary differs in one token converts its own."""
    from unison.bench.model import write_model
    from unison.model.weights import gguf

    monkeypatch.setenv("UNISON_CACHE_DIR", str(tmp_path / "cache"))
    converted = []

    def fake_write(gguf_path: Path, out_dir: Path, context_length: int) -> None:
        converted.append(gguf_path.name)
        (out_dir / "tokenizer.json").write_text(gguf_path.name)

    monkeypatch.setattr(gguf, "_write_tokenizer", fake_write)
    tiny = {"hidden": 64, "layers": 1, "heads": 4, "kv_heads": 2, "ffn": 128}
    files = [write_model(tiny, tmp_path / "a.gguf", seed=0), write_model(tiny, tmp_path / "b.gguf", seed=1),
             write_model(tiny, tmp_path / "c.gguf", seed=0, renames={"<|im_start|>": "<|start|>"}),
             write_model(tiny, tmp_path / "d.gguf", float16=True)]  # another file_type: weights only
    dirs = [resolve_model_dir(f) for f in files]
    assert len(set(dirs)) == 4  # four files, four converted directories
    assert converted == ["a.gguf", "c.gguf"]
    assert [(d / "tokenizer.json").read_text() for d in dirs] == ["a.gguf", "a.gguf", "c.gguf", "a.gguf"]


def test_a_tokenizer_key_covers_what_transformers_reads(tmp_path: Path):
    """Where the conversion names the tokenizer's type (qwen3), transformers reads the tokenizer's
    fields alone: files of other shapes share it. Where it reads the config (llama), the model's
    name can change the tokenizer's class: another name, another key."""
    from gguf import GGUFWriter

    from unison.bench.model import copy_fields, embedded_tokenizer
    from unison.model.weights.gguf import _tokenizer_key

    def write(arch: str, layers: int, name: str) -> Path:
        path = tmp_path / f"{arch}-{layers}-{name}.gguf"
        w = GGUFWriter(path, arch)
        w.add_name(name)
        w.add_block_count(layers)
        copy_fields(w, embedded_tokenizer())
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return path

    key = functools.partial(_tokenizer_key, context_length=512)
    assert key(write("qwen3", 1, "a")) == key(write("qwen3", 2, "b"))
    assert key(write("llama", 1, "a")) != key(write("llama", 1, "mistral-like"))
    assert key(write("llama", 1, "a")) == key(write("llama", 1, "a"))  # (a file written again)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2moe"])
def test_a_gguf_tokenizer_named_by_its_type_is_autotokenizers_own(arch, tmp_path):
    """Where the GGUF's architecture names a tokenizer class, the conversion names it and skips
    transformers' slow read of the file's config: the files it writes are those AutoTokenizer
    writes when it reads the config itself."""
    import filecmp

    from gguf import GGUFWriter
    from transformers import AutoTokenizer

    from unison.bench.model import copy_fields, embedded_tokenizer
    from unison.model.weights.gguf import _tokenizer_type, _write_tokenizer

    path = tmp_path / f"{arch}.gguf"
    w = GGUFWriter(path, arch)
    for key, value in [("block_count", 1), ("context_length", 512), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", 4), ("head_count_kv", 2)]:
        getattr(w, f"add_{key}")(value)
    copy_fields(w, embedded_tokenizer())
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert _tokenizer_type(arch) == {"qwen3": "qwen3", "qwen2moe": "qwen2_moe"}[arch]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    _write_tokenizer(path, ours, 512)  # the conversion itself, not its cache
    AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name).save_pretrained(theirs)
    assert filecmp.cmp(ours / "tokenizer.json", theirs / "tokenizer.json", shallow=False)
    mine = json.loads((ours / "tokenizer_config.json").read_text())
    want = json.loads((theirs / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):  # as _write_tokenizer drops them
        want.pop(key, None)
    assert mine == {**want, "model_max_length": 512}
