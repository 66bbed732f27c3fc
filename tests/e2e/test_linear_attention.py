"""Hybrid families (Qwen3.5 dense and MoE, Qwen3-Next: Gated DeltaNet layers with a state per
request) and shared experts (Qwen2-MoE): tiny random models made with transformers, against
transformers; the recurrence's kernel against its torch form; its bits alone or batched, whole or
chunked; the state pool in the engine; and what is refused, by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils import _hf_greedy, greedy
from unison import Engine
from unison.model.decoder import TorchOps
from unison.model.families import ModelConfig
from unison.model.kernels import cpu_kernels
from unison.model.layers.linear_attention import DeltaStates, delta_rule_reference
from unison.model.runner import BatchItem, ModelRunner

KERNELS = cpu_kernels.load()
VOCAB = 49152  # the embedded tokenizer's: the engine tests send text
NEW_TOKENS = 8
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
         "bos_token_id": 1, "eos_token_id": 2}
LINEAR = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 64}
# kind -> (transformers config class, its options)
KINDS = {
    "qwen3_5": ("Qwen3_5TextConfig", LINEAR),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", LINEAR | MOE),
    "qwen3_next": ("Qwen3NextConfig", LINEAR | MOE),
    "qwen2_moe": ("Qwen2MoeConfig", MOE | {"head_dim": None}),
}
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (3, 5, 8, 11, 13, 17, 19, 21, 24, 29, 31, 36, 40, 44, 51, 60)]


def tiny(kind: str, path: Path, tokenizer_dir: Path | None = None, **changes) -> Path:
    """KINDS[kind] with seeded random weights, saved by transformers in `path` (with the
    embedded model's tokenizer when `tokenizer_dir` is given)."""
    import transformers

    name, extra = KINDS[kind]
    torch.manual_seed(0)
    options = {k: v for k, v in (SHAPE | extra | changes).items() if v is not None}
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**options),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():  # random init is near-zero; widen it so positions, heads and routes matter
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    hf.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if tokenizer_dir is not None and (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, path / f)
    return path


class _Models(dict):
    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        super().__init__()
        self.root, self.tokenizer_dir = root, tokenizer_dir

    def __missing__(self, kind: str) -> Path:
        self[kind] = path = tiny(kind, self.root / kind, self.tokenizer_dir)
        return path


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dir) -> _Models:
    return _Models(tmp_path_factory.mktemp("hybrid"), model_dir)


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _first_step(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    return runner.forward([BatchItem(p, 0, t, len(p) - 1, state_slot=i)
                           for i, (p, t) in enumerate(zip(prompts, tables))])


GGUF_ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next",
             "qwen2_moe": "qwen2moe", "qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe"}


def write_gguf(model_dir: Path, kind: str, out: Path, qtype: str = "F32", drop: str | None = None,
               narrow: str | None = None, mtp: bool = False, extra_tokens: tuple[str, ...] = ()) -> Path:
    """The HF model in `model_dir` as llama.cpp's converter writes it (convert_hf_to_gguf.py's
    Qwen2MoeModel, Qwen3NextModel and the Qwen3.5 classes): its names, the norms' folded + 1 (not
    ssm_norm's), -exp(A_log), the convolution squeezed, Qwen3-Next's qkvz split into q|k|v and z,
    a Qwen3.5's value heads reordered (HF's k * r + j to j * K + k), stacked experts; linears in
    `qtype` (F32, Q8_0, Q4_0); the embedded tokenizer. `drop` leaves a tensor out, `narrow` writes
    one with a row too few: broken files. `mtp` adds a multi-token-prediction block after the
    decoder's, counted in block_count, as newer converters keep it. A multimodal checkpoint's
    text model is written as the converter writes it beside its mmproj file, the vocabulary grown
    by `extra_tokens` (control tokens: a picture's) and unused ones to the model's size."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from unison.bench.model import copy_fields, embedded_tokenizer
    from unison.model.weights.gpt_oss import FusedExperts
    from unison.model.weights.sources import RenamedWeights, SafetensorsWeights

    mc = ModelConfig.from_dir(model_dir)
    # a multimodal checkpoint's text model (model.language_model.) read under model., its fused
    # experts (Qwen3-VL-MoE's) one by one
    src = RenamedWeights(SafetensorsWeights(model_dir), "model.", mc.family.text_prefix)
    if mc.family.fused_experts:
        src = FusedExperts(src, mc.family.fused_experts, mc.hidden_size)
    arch, lin, moe = GGUF_ARCH[kind], mc.linear, mc.moe
    w = GGUFWriter(out, arch)
    fields = {"block_count": mc.num_hidden_layers + mtp, "context_length": mc.max_position_embeddings,
              "embedding_length": mc.hidden_size, "feed_forward_length": mc.intermediate_size,
              "head_count": mc.num_attention_heads, "head_count_kv": mc.num_key_value_heads,
              "key_length": mc.head_dim, "value_length": mc.head_dim, "rope_freq_base": mc.ropes[0].theta,
              "layer_norm_rms_eps": mc.rms_norm_eps, "vocab_size": mc.vocab_size}
    if moe is not None:
        fields |= {"expert_count": moe.num_experts, "expert_used_count": moe.top_k,
                   "expert_feed_forward_length": moe.intermediate_size}
    if moe is not None and moe.shared_intermediate_size:
        fields["expert_shared_feed_forward_length"] = moe.shared_intermediate_size
    if lin is not None:
        fields |= {"ssm_conv_kernel": lin.conv_kernel, "ssm_state_size": lin.head_k_dim,
                   "ssm_group_count": lin.num_k_heads, "ssm_time_step_rank": lin.num_v_heads,
                   "ssm_inner_size": lin.value_dim, "full_attention_interval": 4,
                   "rope_dimension_count": mc.ropes[0].head_dim}
    if kind.startswith(("qwen3_5", "qwen3_vl")):  # the checkpoints' mrope_section, padded to four
        fields["rope_dimension_sections"] = [*(mc.ropes[0].mrope_section or (11, 11, 10)), 0]
    if kind.startswith("qwen3_vl"):  # (the text model adds what the mmproj file's DeepStack mergers give)
        vision = json.loads((model_dir / "config.json").read_text())["vision_config"]
        w.add_uint32(f"{arch}.n_deepstack_layers", len(vision["deepstack_visual_indexes"]))
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    for key, value in fields.items():
        getattr(w, f"add_{key}")(value)
    grown = [*extra_tokens, *(f"<unused_{i}>" for i in range(mc.vocab_size - VOCAB - len(extra_tokens)))]
    copy_fields(w, embedded_tokenizer(), extend={"tokenizer.ggml.tokens": grown,
                                                 "tokenizer.ggml.scores": [0.0] * len(grown),
                                                 "tokenizer.ggml.token_type": [3] * len(grown)})
    hybrid = lin is not None
    r = lin.num_v_heads // lin.num_k_heads if hybrid else 1
    tile = kind != "qwen3_next" and hybrid and r > 1  # the converter's V-head reorder (Qwen3.5)

    def tiled(t: np.ndarray, block: int, axis: int = 0, start: int = 0) -> np.ndarray:
        if not tile:
            return t
        t = np.moveaxis(t, axis, 0).copy()
        part = t[start:]
        shape = part.shape
        part = part.reshape(lin.num_k_heads, r, block, *shape[1:]).swapaxes(0, 1).reshape(shape)
        t[start:] = part
        return np.moveaxis(t, 0, axis)

    def add(name: str, t: np.ndarray, kind_: str) -> None:
        if name == drop:
            return
        t = t[:-1] if name == narrow else t
        floats = ("_norm.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
        if kind_ == "F32" or t.ndim == 1 or name.endswith(floats):
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
        else:
            q = GGMLQuantizationType[kind_]
            w.add_tensor(name, quants.quantize(np.ascontiguousarray(t, dtype=np.float32), q), raw_dtype=q)

    get = lambda name: src.float(name).numpy()  # noqa: E731
    plus = 1.0 if hybrid else 0.0  # the converter folds (1 + w) into these norms
    add("token_embd.weight", get("model.embed_tokens.weight"), qtype if qtype == "F32" else "Q8_0")
    add("output_norm.weight", get("model.norm.weight") + plus, "F32")
    add("output.weight", get("lm_head.weight"), qtype if qtype == "F32" else "Q8_0")
    for i in range(mc.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", get(p + "input_layernorm.weight") + plus, "F32")
        add(b + ("post_attention_norm.weight" if hybrid else "ffn_norm.weight"),
            get(p + "post_attention_layernorm.weight") + plus, "F32")
        if i in mc.linear_layers:
            a, kd, vd = p + "linear_attn.", lin.key_dim, lin.value_dim
            if kind == "qwen3_next":  # [q, k, v, z] per key head -> q|k|v and z
                qkvz = get(a + "in_proj_qkvz.weight").reshape(lin.num_k_heads, -1, mc.hidden_size)
                dk, rv = lin.head_k_dim, r * lin.head_v_dim
                v_end = 2 * dk + rv
                parts = [qkvz[:, :dk], qkvz[:, dk: 2 * dk], qkvz[:, 2 * dk: v_end], qkvz[:, v_end:]]
                qkv = np.concatenate([x.reshape(-1, mc.hidden_size) for x in parts[:3]])
                z = parts[3].reshape(-1, mc.hidden_size)
                add(b + "ssm_ba.weight", get(a + "in_proj_ba.weight"), qtype)
            else:
                qkv, z = get(a + "in_proj_qkv.weight"), get(a + "in_proj_z.weight")
                add(b + "ssm_beta.weight", tiled(get(a + "in_proj_b.weight"), 1), qtype)
                add(b + "ssm_alpha.weight", tiled(get(a + "in_proj_a.weight"), 1), qtype)
            add(b + "attn_qkv.weight", tiled(qkv, lin.head_v_dim, start=2 * kd), qtype)
            add(b + "attn_gate.weight", tiled(z, lin.head_v_dim), qtype)
            conv = get(a + "conv1d.weight").reshape(lin.conv_dim, lin.conv_kernel)
            add(b + "ssm_conv1d.weight", tiled(conv, lin.head_v_dim, start=2 * kd), "F32")
            add(b + "ssm_dt.bias", tiled(get(a + "dt_bias"), 1), "F32")
            add(b + "ssm_a", tiled(-np.exp(get(a + "A_log")), 1), "F32")
            add(b + "ssm_norm.weight", get(a + "norm.weight"), "F32")
            add(b + "ssm_out.weight", tiled(get(a + "out_proj.weight"), lin.head_v_dim, axis=1), qtype)
            assert vd == z.shape[0]
        else:
            for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
                add(b + f"attn_{g}.weight", get(p + f"self_attn.{h}_proj.weight"), qtype)
                if g != "output" and src.__contains__(p + f"self_attn.{h}_proj.bias"):
                    add(b + f"attn_{g}.bias", get(p + f"self_attn.{h}_proj.bias"), "F32")
            if mc.family.qk_norm:
                add(b + "attn_q_norm.weight", get(p + "self_attn.q_norm.weight") + plus, "F32")
                add(b + "attn_k_norm.weight", get(p + "self_attn.k_norm.weight") + plus, "F32")
        m = p + "mlp."
        if moe is None:
            for proj in ("gate", "up", "down"):
                add(b + f"ffn_{proj}.weight", get(m + f"{proj}_proj.weight"), qtype)
            continue
        add(b + "ffn_gate_inp.weight", get(m + "gate.weight"), "F32")
        for proj in ("gate", "up", "down"):
            stacked = np.stack([get(m + f"experts.{e}.{proj}_proj.weight") for e in range(moe.num_experts)])
            add(b + f"ffn_{proj}_exps.weight", stacked, qtype)
            if moe.shared_intermediate_size:
                add(b + f"ffn_{proj}_shexp.weight", get(m + f"shared_expert.{proj}_proj.weight"), qtype)
        if moe.shared_intermediate_size:
            add(b + "ffn_gate_inp_shexp.weight", get(m + "shared_expert_gate.weight"), "F32")
    if mtp:  # (its own names: eh_proj and the rest; any tensor of the block stands for them here)
        add(f"blk.{mc.num_hidden_layers}.nextn.eh_proj.weight", np.ones((64, 128), np.float32), "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---- parity ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_gguf_as_llama_cpp_writes_it_matches_transformers(models, kind: str, tmp_path: Path):
    """The same model written as llama.cpp's converter writes it (float32): transformers' greedy
    tokens on at least 15 of 16 prompts, first-step top-5 logprobs within 1e-3; and in Q8_0
    blocks, run as stored, a row's bits alone equal its bits in the batch."""
    path = write_gguf(models[kind], kind, tmp_path / f"{kind}.gguf", mtp=kind == "qwen3_5")
    runner = ModelRunner(path, quantization="none", num_blocks=256, block_size=8, state_slots=16)
    _check_parity(runner, models[kind], kind, f"{kind} GGUF")
    q8_path = write_gguf(models[kind], kind, tmp_path / "q8.gguf", "Q8_0")
    q8 = ModelRunner(q8_path, num_blocks=512, block_size=8, state_slots=16)
    kinds = q8.model.linear_kinds()
    assert kinds["layers.3.o_proj"].startswith("q8_0")  # Q8_0 as stored
    assert kind == "qwen2_moe" or kinds["layers.0.out_proj"].startswith("q8_0")
    together = _prefill_and_decode(q8, PROMPTS[:4])
    alone = _prefill_and_decode(q8, PROMPTS[2:3])
    assert torch.equal(alone[0][0], together[0][2]) and torch.equal(alone[1][0], together[1][2])
    if kind.startswith("qwen3_5"):  # transformers reads these GGUFs: the same Q8_0 blocks, in float
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q8.gguf", dtype=torch.float32).eval()
        with torch.inference_mode():
            want = torch.log_softmax(ref(torch.tensor([PROMPTS[2]])).logits[0, -1], -1)
        gap = (torch.log_softmax(together[0][2], -1) - want).abs().max().item()
        print(f"[figure] {kind} Q8_0 GGUF against the same blocks in float: largest logprob gap {gap:.3f}")
        assert gap < 0.15  # tests/unit/test_quant.py's bound for the 16-bit activations on quantized weights


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_the_gguf_writer_agrees_with_transformers_gguf_loader(models, kind: str, tmp_path: Path):
    """transformers' own GGUF loader (which undoes llama.cpp's converter) reads write_gguf's file
    back into the checkpoint's logits: the file above is llama.cpp's layout, not just ours."""
    from transformers import AutoModelForCausalLM

    write_gguf(models[kind], kind, tmp_path / "m.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[9]])
    with torch.inference_mode():
        torch.testing.assert_close(theirs(ids).logits, _hf(models[kind])(ids).logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers(models, kind: str, path: str):
    """16 prompts together, 8 greedy tokens: equal to transformers on at least 15; first-step
    top-5 logprobs within 1e-3, in float32; through the C kernels and through torch's ops."""
    runner = ModelRunner(models[kind], quantization="none", num_blocks=256, block_size=8, state_slots=16)
    if path == "torch":
        runner.model.ops, runner._kernel = TorchOps(), None
    _check_parity(runner, models[kind], kind, f"{kind} ({path})")


def _check_parity(runner: ModelRunner, hf_dir: Path, kind: str, name: str) -> None:
    """The 16 prompts together, 8 greedy tokens: transformers' on at least 15 of them, and the
    first step's top-5 logprobs within 1e-3 (float32 both sides)."""
    assert runner.config.family.name == kind
    ref = _hf_greedy(_hf(hf_dir), PROMPTS, NEW_TOKENS)
    got = greedy(runner, PROMPTS, NEW_TOKENS)
    same = sum(ids == ref_ids for (ids, _), (ref_ids, _) in zip(got, ref))
    first = torch.log_softmax(_first_step(runner, PROMPTS), dim=-1)
    worst = max(abs(row[t].item() - lp) for row, (_, tops) in zip(first, ref) for t, lp in tops[0].items())
    print(f"\n[figure] {name}: greedy equal on {same}/16; first-step top-5 logprob gap {worst:.2e}")
    assert same >= 15 and worst < 1e-3


def test_multimodal_checkpoint_runs_its_text_model(tmp_path: Path):
    """Qwen3.5 as published: Qwen3_5ForConditionalGeneration, the text model under
    model.language_model beside a vision tower (loaded: its image token is named in
    tokenizer.json). A text prompt gives that model's logits."""
    import transformers

    torch.manual_seed(0)
    text = {k: v for k, v in (SHAPE | LINEAR).items()} | {"vocab_size": 512}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 16}
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=511)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    hf.save_pretrained(tmp_path)
    added = [{"id": 511, "content": "<|image_pad|>"}]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    ids = torch.randint(0, 511, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    runner = ModelRunner(tmp_path, quantization="none", num_blocks=8, block_size=8, state_slots=2)
    assert runner.config.architecture == "Qwen3_5ForConditionalGeneration" and runner.vision is not None
    got = runner.forward([BatchItem(ids, 0, [0, 1, 2], len(ids) - 1, state_slot=0)])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_long_prompt_gives_transformers_tokens(models, tmp_path: Path):
    """A 4,000-token prompt on a 32k-context config: transformers' greedy tokens (its chunked
    form of the recurrence, ours one token at a time)."""
    path = tiny("qwen3_5", tmp_path / "long", max_position_embeddings=32768)
    prompt = torch.randint(0, VOCAB, (4000,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = _hf_greedy(_hf(path), [prompt], 4)
    runner = ModelRunner(path, quantization="none", num_blocks=520, block_size=8, state_slots=1)
    got = greedy(runner, [prompt], 4)
    assert got[0][0] == ref[0][0]


# ---- the recurrence and its bits ---------------------------------------------------------------

def _random_step(slots: list[int], counts: list[int], cfg, generator) -> tuple:
    rows = sum(counts)
    x = torch.randn(rows, cfg.conv_dim, generator=generator)
    g = -torch.rand(rows, cfg.num_v_heads, generator=generator)
    beta = torch.rand(rows, cfg.num_v_heads, generator=generator)
    return x, g, beta


@pytest.mark.skipif(KERNELS is None, reason="no C compiler here")
def test_kernel_matches_the_torch_recurrence(models):
    """csrc/gated_delta.c against delta_rule_reference (transformers' recurrent form) over three
    requests of different lengths, one of them resuming a state: the same within float32 noise."""
    cfg = ModelConfig.from_dir(models["qwen3_5"]).linear
    gen = torch.Generator().manual_seed(0)
    conv_w = torch.randn(cfg.conv_dim, cfg.conv_kernel, generator=gen)
    ours, ref = (DeltaStates(cfg, 1, 4, torch.device("cpu")) for _ in range(2))
    for states in (ours, ref):
        states.conv[0, 2] = 0.5
        states.rec[0, 2] = 0.1
    slots, counts = [0, 2, 3], [7, 1, 12]
    x, g, beta = _random_step(slots, counts, cfg, gen)
    ours.begin(slots, counts, [0, 3])
    ref.begin(slots, counts, [0, 3])
    got = KERNELS.gated_delta(x, g, beta, conv_w, *ours.layer(0), ours.current)
    want = delta_rule_reference(x, g, beta, conv_w, *ref.layer(0), ref.current, cfg)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.rec, ref.rec, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.conv, ref.conv)  # the convolution's state is the inputs themselves


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_rows_are_bit_identical_alone_or_together_whole_or_chunked(models, kind: str):
    """Quantized (the C kernels throughout): each request's logits are the same bits alone or
    with the 15 others, and prefilled whole or in chunks of 5 beside other work."""
    runner = ModelRunner(models[kind], quantization="int8", num_blocks=512, block_size=8, state_slots=16)
    together = _prefill_and_decode(runner, PROMPTS)
    for i, p in enumerate(PROMPTS):
        alone = _prefill_and_decode(runner, [p])
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i]), i
    for i in (6, 13):  # 19 and 44 tokens, in chunks of 5, each chunk beside a whole other prompt
        prompt, table = PROMPTS[i], list(range(64))
        for start in range(0, len(prompt), 5):
            chunk = prompt[start: start + 5]
            rows = runner.forward([BatchItem(PROMPTS[0], 0, list(range(100, 108)), 2, state_slot=1),
                                   BatchItem(chunk, start, table, len(chunk) - 1, state_slot=0)])
        assert torch.equal(rows[-1], together[0][i]), i


def _prefill_and_decode(runner: ModelRunner, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    tables = [list(range(128 + 8 * i, 128 + 8 * i + 8)) for i in range(len(prompts))]
    first = runner.forward([BatchItem(p, 0, t, len(p) - 1, state_slot=i)
                            for i, (p, t) in enumerate(zip(prompts, tables))])
    nxt = runner.forward([BatchItem([int(r.argmax())], len(p), t, 0, state_slot=i)
                          for i, (p, t, r) in enumerate(zip(prompts, tables, first))])
    return first, nxt


def test_state_memory_counts_in_the_kv_budget(models):
    """The state pool is paid for out of kv_cache_memory_gb; too small a budget is refused
    naming it and the state's size."""
    path = models["qwen3_5"]
    few = ModelRunner(path, quantization="none", kv_cache_memory_gb=0.01, state_slots=4)
    many = ModelRunner(path, quantization="none", kv_cache_memory_gb=0.01, state_slots=64)
    b, budget = few.budget, int(0.01 * (1 << 30))
    assert b.state_bytes == 4 * b.slot_bytes and few.states.nbytes == b.state_bytes
    assert few.num_blocks == (budget - 4 * b.slot_bytes) // few.bytes_per_block
    assert many.num_blocks == (budget - 64 * b.slot_bytes) // few.bytes_per_block
    with pytest.raises(ValueError, match="kv_cache_memory_gb.*linear-attention states"):
        ModelRunner(path, quantization="none", kv_cache_memory_gb=1e-5, state_slots=64)
    # The default budget (a quarter of free memory) keeps half for KV: fewer slots than asked
    capped = ModelRunner(path, quantization="none", state_slots=10**7, state_snapshots=10**7)
    assert 1 <= capped.states.slots < 10**7
    # the states take half the budget, give or take a block
    assert capped.budget.state_bytes <= (capped.num_blocks + 1) * capped.bytes_per_block


# ---- the engine ---------------------------------------------------------------------------------

def test_engine_on_a_hybrid_model(models):
    """Through the Engine: chunked prefill gives whole prefill's tokens; more requests than state
    slots wait for one and finish alike; prefix-cache hits resume from a state snapshot and give
    a cold run's tokens; the info reports the weights; the pools stay whole."""
    path = str(models["qwen3_next"])
    texts = ["the quick brown fox jumps over the lazy dog " * 6, "one two three four five six " * 8,
             "hello there", "a b c d e f g h i j k"]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(model_path=path, num_threads=1, max_total_tokens=4096, quantization="int8",
                disable_radix_cache=True) as engine:
        whole = [o["output_ids"] for o in engine.generate(texts, params)]
        follow = engine.generate(texts[0] + " and then the dog wakes up", params)["output_ids"]
        info = engine.get_server_info()
        assert info["weights"]["layers.0.in_proj"].startswith("int8")
        assert info["weights"]["layers.0.shared_gate_up"].startswith("int8")
    with Engine(model_path=path, num_threads=1, max_total_tokens=4096, quantization="int8",
                chunked_prefill_size=16, max_running_requests=2, state_snapshot_interval=32) as engine:
        assert [o["output_ids"] for o in engine.generate(texts, params)] == whole
        # Two snapshots (max_running_requests): the last prompts' took them; this one's are back
        assert engine.generate(texts[0], params)["output_ids"] == whole[0]
        for _ in range(2):  # the same prompt, then one that extends it: both resume a snapshot
            again = engine.generate(texts[0], params)
            assert again["output_ids"] == whole[0] and again["meta_info"]["cached_tokens"] >= 32
            longer = engine.generate(texts[0] + " and then the dog wakes up", params)
            assert longer["output_ids"] == follow and longer["meta_info"]["cached_tokens"] >= 32
        engine.check_integrity()  # every block, state slot and snapshot free or held once


def test_speculation_rolls_the_state_back_to_the_tokens_kept(models, tmp_path: Path):
    """n-gram drafts on a hybrid: a rejected draft's tokens are taken back out of the state by
    replaying the kept ones onto the state before the step, so the output is plain decoding's
    bit for bit, with drafts both accepted and rejected along the way; int8 KV beside it."""
    path = str(tiny("qwen3_5_moe", tmp_path / "m", models.tokenizer_dir, head_dim=32))  # int8 KV: 32s
    texts = ["one two three four five six seven eight nine ten " * 5, "the cat sat on the mat. " * 9,
             "a b c d e f g h i j k l m n o p"]
    # Random weights never repeat themselves: held to three tokens, the model's choice among them
    # makes drafts that are kept in part
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True,
              "logit_bias": {"100": 50.0, "200": 50.0, "300": 50.0}}
    common = {"model_path": path, "num_threads": 1, "max_total_tokens": 4096, "quantization": "int8",
              "kv_cache_dtype": "int8"}
    with Engine(**common) as engine:
        plain = [o["output_ids"] for o in engine.generate(texts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with Engine(**common, speculative_config=spec) as engine:
        assert [o["output_ids"] for o in engine.generate(texts, params)] == plain
        stats = engine.get_server_info()["stats"]["spec_decode"]
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # kept some, threw some back
        engine.check_integrity()


@pytest.mark.parametrize("kind, targets", [
    ("qwen3_5", ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")),
    ("qwen3_next", ("q_proj", "k_proj", "o_proj"))])
def test_lora_on_attention_and_mlp_matches_peft(models, tmp_path: Path, kind: str, targets: tuple[str, ...]):
    """A PEFT adapter on a hybrid's full-attention layers (the gated q_proj at its double width)
    and dense MLPs: PEFT's logits, with the base model's rows unchanged beside it in the batch;
    an adapter naming a linear-attention layer's q_proj is refused by name."""
    from safetensors.torch import load_file, save_file

    from tests.adapters import make_adapter, peft_model
    from unison.model.layers.lora import read_peft

    adapter = make_adapter(tmp_path / "a", targets=targets, rank=4, model_dir=models[kind])
    runner = ModelRunner(models[kind], quantization="none", num_blocks=64, block_size=8, state_slots=4)
    runner.add_lora(1, read_peft(adapter, runner.config, 16))
    prompt = PROMPTS[8]
    with torch.inference_mode():
        want = peft_model(adapter, models[kind])(torch.tensor([prompt])).logits[0, -1]
    base = _first_step(runner, [prompt])[0]
    both = runner.forward([BatchItem(prompt, 0, list(range(8)), len(prompt) - 1, 1, state_slot=0),
                           BatchItem(prompt, 0, list(range(8, 16)), len(prompt) - 1, 0, state_slot=1)])
    torch.testing.assert_close(both[0], want, rtol=0, atol=1e-3)
    torch.testing.assert_close(both[1], base, rtol=0, atol=1e-4)  # (float GEMMs: batch shapes round apart)
    assert not torch.allclose(both[0], base, atol=1e-2)

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = next(k for k in tensors if ".layers.3.self_attn.q_proj." in k)
    tensors[key.replace(".layers.3.", ".layers.0.")] = tensors[key].clone()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="q_proj of layer 0, a linear-attention layer"):
        read_peft(adapter, runner.config, 16)


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, change, match", [
    ("missing", "drop", "model.layers.1.linear_attn.dt_bias"),
    ("shape", "narrow", "model.layers.0.linear_attn.in_proj_z.weight"),
])
def test_broken_checkpoints_are_refused_naming_the_tensor(models, tmp_path: Path, name, change, match):
    from safetensors.torch import load_file, save_file

    src = models["qwen3_5"]
    out = tmp_path / name
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    if change == "drop":
        del tensors["model.layers.1.linear_attn.dt_bias"]
    else:
        tensors["model.layers.0.linear_attn.in_proj_z.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        ModelRunner(out, quantization="none", num_blocks=8, state_slots=1)


@pytest.mark.parametrize("kind, change, name", [
    ("qwen3_5", "drop", "blk.1.ssm_dt.bias"),
    ("qwen3_next", "narrow", "blk.0.attn_gate.weight"),
    ("qwen3_5_moe", "narrow", "blk.2.ffn_up_shexp.weight"),
    ("qwen2_moe", "drop", "blk.0.ffn_gate_inp_shexp.weight"),
])
def test_broken_gguf_files_are_refused_naming_the_tensor(models, tmp_path: Path, kind, change, name):
    path = write_gguf(models[kind], kind, tmp_path / "broken.gguf", **{change: name})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ModelRunner(path, quantization="none", num_blocks=8, state_slots=1)


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
])
def test_configs_it_cannot_run_are_refused_by_name(models, tmp_path: Path, change: dict, match: str):
    cfg = json.loads((models["qwen3_5"] / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dir(tmp_path)


def test_fused_projections_are_reordered_as_transformers_splits_them():
    """Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba columns, reordered, are transformers'
    own split (fix_query_key_value_ordering) laid side by side."""
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from unison.model.layers.linear_attention import projection_order

    cfg = transformers.Qwen3NextConfig(**(SHAPE | LINEAR | MOE))
    layer = Qwen3NextGatedDeltaNet(cfg, 0)
    qkvz, ba = torch.randn(3, 2 * 32 + 2 * 64), torch.randn(3, 8)
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(qkvz[:, None], ba[:, None])
    want = torch.cat([t.reshape(3, -1) for t in (q, k, v, z, b, a)], dim=1)
    hf = cfg.to_dict() | {"architectures": ["Qwen3NextForCausalLM"]}
    order = projection_order(ModelConfig.from_hf(hf).linear, fused_qkvz=True, fused_ba=True)
    assert torch.equal(torch.cat([qkvz, ba], dim=1)[:, order], want)
    assert sorted(order.tolist()) == list(range(qkvz.shape[1] + ba.shape[1]))
    assert np.unique(order.numpy()).size == order.numel()


# ---- the prefix cache's state snapshots ---------------------------------------------------------

def test_radix_cache_keeps_blocks_only_with_a_snapshot_and_matches_back_to_one():
    """A hybrid's cache: a prefix comes in with the state after it or not at all; a match ends at
    the deepest snapshot on its path; a split leaves the snapshot with the node that ends there;
    a full snapshot pool gives up its least recently used one (and the blocks only it made
    reachable); the pools stay whole throughout."""
    from unison.core.kv.block_pool import BlockPool
    from unison.core.kv.radix_cache import RadixCache
    from unison.core.kv.state_pool import StatePool

    pool, snapshots = BlockPool(32), StatePool(2, first=4)
    cache = RadixCache(pool, 4, snapshots=snapshots)

    def cached(tokens: list[int], with_state: bool) -> None:
        blocks = pool.allocate(len(tokens) // 4)
        state = cache.take_snapshot() if with_state else -1
        cache.insert(tokens, blocks, 0, state)
        pool.release(blocks)  # the request's own hold goes; the tree keeps its own

    a = list(range(16))
    cached(a[:8], with_state=False)
    assert cache.num_blocks == 0  # blocks without the state after them could never be a hit
    cached(a, with_state=True)
    blocks, node = cache.match(a + [99])
    assert len(blocks) == 4 and node.state == 4
    assert cache.match(a[:12] + [7, 7, 7, 7])[0] == []  # its path has no snapshot before 16
    cached(a[:8], with_state=True)  # splits the node at 8: each part keeps the state at its end
    assert [len(cache.match(t)[0]) for t in (a[:12], a + [1])] == [2, 4]
    cache.check_integrity()
    b = [50 + i for i in range(8)]
    cached(b, with_state=True)  # the pool is full: the least recently used snapshot (at 8) goes
    assert snapshots.num_free == 0 and len(cache.snapshot_slots()) == 2
    assert [len(cache.match(t)[0]) for t in (b + [1], a[:12], a + [1])] == [2, 0, 4]
    blocks_before = cache.num_blocks
    cached([90 + i for i in range(4)], with_state=True)  # now b's goes, and its leaf's blocks with it
    assert cache.match(b + [1])[0] == [] and cache.num_blocks == blocks_before - 2 + 1
    cache.check_integrity()
    pool.check_integrity([cache.blocks()])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_compiled_forward_is_the_python_forward(models, kind: str, quantization: str, monkeypatch):
    """Quantized on CPU, a step is one C call (csrc/decoder.c): the Gated DeltaNet layers over
    the state pool, the gated attention, the shared expert. Its logits and the states it leaves
    are the Python forward's, bit for bit, prefill and decode, 16 requests together."""
    runner = ModelRunner(models[kind], quantization=quantization, num_blocks=512, block_size=8,
                         state_slots=16)
    assert runner._compiled is not None
    compiled = _prefill_and_decode(runner, PROMPTS)
    states = None if runner.states is None else (runner.states.conv.clone(), runner.states.rec.clone())
    monkeypatch.setattr(runner, "_compiled", None)  # the Python forward, kernel by kernel
    python = _prefill_and_decode(runner, PROMPTS)
    assert torch.equal(compiled[0], python[0]) and torch.equal(compiled[1], python[1])
    if states is not None:
        assert torch.equal(states[0], runner.states.conv) and torch.equal(states[1], runner.states.rec)
