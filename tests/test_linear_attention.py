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
from unison.model import cpu_kernels
from unison.model.decoder import TorchOps
from unison.model.families import ModelConfig
from unison.model.linear_attention import DeltaStates, delta_rule_reference
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
       "shared_expert_intermediate_size": 48}
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


# ---- parity ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers(models, kind: str, path: str):
    """16 prompts together, 8 greedy tokens: equal to transformers on at least 15; first-step
    top-5 logprobs within 1e-3, in float32; through the C kernels and through torch's ops."""
    ref = _hf_greedy(_hf(models[kind]), PROMPTS, NEW_TOKENS)
    runner = ModelRunner(models[kind], quantization="none", num_blocks=256, block_size=8, state_slots=16)
    assert runner.config.family.name == kind
    if path == "torch":
        runner.model.ops, runner._kernel = TorchOps(), None
    got = greedy(runner, PROMPTS, NEW_TOKENS)
    same = sum(ids == ref_ids for (ids, _), (ref_ids, _) in zip(got, ref))
    first = torch.log_softmax(_first_step(runner, PROMPTS), dim=-1)
    worst = max(abs(row[t].item() - lp) for row, (_, tops) in zip(first, ref) for t, lp in tops[0].items())
    print(f"\n[figure] {kind} ({path}): greedy equal on {same}/16; first-step top-5 logprob gap {worst:.2e}")
    assert same >= 15 and worst < 1e-3


def test_multimodal_checkpoint_runs_its_text_model(tmp_path: Path):
    """Qwen3.5 as published: Qwen3_5ForConditionalGeneration, the text model under
    model.language_model beside a vision tower. A text prompt gives that model's logits."""
    import transformers

    torch.manual_seed(0)
    text = {k: v for k, v in (SHAPE | LINEAR).items()} | {"vocab_size": 512}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 16}
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    runner = ModelRunner(tmp_path, quantization="none", num_blocks=8, block_size=8, state_slots=2)
    assert runner.config.architecture == "Qwen3_5ForConditionalGeneration"
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
    assert few.state_bytes == 4 * few.state_slot_bytes and few.states.nbytes == few.state_bytes
    assert few.num_blocks - many.num_blocks == 60 * few.state_slot_bytes // few.bytes_per_block
    with pytest.raises(ValueError, match="kv_cache_memory_gb.*linear-attention states"):
        ModelRunner(path, quantization="none", kv_cache_memory_gb=1e-5, state_slots=64)


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


def test_speculation_and_lora_are_refused_by_name(models, tmp_path: Path):
    from tests.adapters import make_adapter

    path = str(models["qwen3_5"])
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(Exception, match="speculative_config.*linear-attention"):
        Engine(model_path=path, num_threads=1, max_total_tokens=1024, speculative_config=spec)
    runner = ModelRunner(path, quantization="none", num_blocks=16, state_slots=2)
    adapter = make_adapter(tmp_path / "a", targets=("q_proj",), rank=4, model_dir=models["qwen2_moe"])
    from unison.model.lora import read_peft

    with pytest.raises(ValueError, match="LoRA adapters are not run on Qwen3_5ForCausalLM"):
        runner.add_lora(1, read_peft(adapter, ModelConfig.from_dir(models["qwen2_moe"]), 16))


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

    from unison.model.linear_attention import projection_order

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
    from unison.core.block_pool import BlockPool
    from unison.core.radix_cache import RadixCache
    from unison.core.state_pool import StatePool

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
