"""Quantized weights on CPU, in-process: the kernel against a reference matmul, every GGUF tensor
type into the kernel's blocks, quality against the float32 path, bad input (through the engine:
tests/e2e/test_quant.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils import TEXTS, Blocks, assert_greedy_close, greedy
from unison.bench.datasets import QUIZ
from unison.config import EngineConfig
from unison.frontend.text.tokenizer import Tokenizer
from unison.model.kernels import cpu_kernels
from unison.model.runner import BatchItem, ModelRunner
from unison.model.weights import quant
from unison.model.weights.gguf import GGUFWeights
from unison.model.weights.loader import default_gguf_path

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here: no quantized kernels")
QUALITY_GAP = 0.15  # quantized against float32: greedy divergence only at a top-2 gap below this


def reference_matmul(x: torch.Tensor, weight: quant.QuantWeight) -> torch.Tensor:
    """x @ W.T in float64 from the values the kernel sees: the weights as stored, the activations
    as it quantizes them (int16 per 32-block)."""
    q, scales = KERNELS.act16(x, weight.kp)
    a = (q.double() * scales.double().repeat_interleave(quant.QBLOCK, 1))[:, : x.shape[1]]
    w = KERNELS.dequantize_rows(weight, torch.arange(weight.n)).double()
    return a @ w.T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", [(960, 576), (40, 100), (13, 32), (576, 1536)])
def test_kernel_equals_reference_matmul(bits: int, n: int, k: int):
    """Shape by shape: batch 1, odd batches, k not a multiple of the block, n not of the tile."""
    g = torch.Generator().manual_seed(n + k + bits)
    weight = quant.quantize(torch.randn(n, k, generator=g), bits)
    plan = cpu_kernels.QuantPlan([weight])
    for m in (1, 3, 7, 64, 65):
        x = torch.randn(m, k, generator=g) * 3
        got = KERNELS.quant_linear(x, plan)
        want = reference_matmul(x, weight)
        assert got.shape == (m, n)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"int{bits} [{m}, {k}] x [{n}, {k}]: relative error {err:.2e}"


def test_kernel_rows_do_not_depend_on_the_batch_or_threads():
    """Each row's result is bit-identical alone, in any batch, and at any thread count: the
    activation scales are per row and block, and k is reduced in one fixed order."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=g)
    x[5] *= 50  # an outlier row: one activation scale across the batch would change the others
    threads = torch.get_num_threads()
    for bits in (4, 8):
        plan = cpu_kernels.QuantPlan([quant.quantize(torch.randn(264, 576, generator=g), bits)])
        together = KERNELS.quant_linear(x, plan)
        for i in (0, 5, 36):
            assert torch.equal(KERNELS.quant_linear(x[i: i + 1], plan)[0], together[i])
        torch.set_num_threads(1)
        try:
            assert torch.equal(KERNELS.quant_linear(x, plan), together)
        finally:
            torch.set_num_threads(threads)


# ---- one result on every instruction-set path -------------------------------------------------

# Each compared with the first path this machine runs (avx2 on any x86 CPU of the last decade).
PATHS = ["vnni", "amx"]


def _on_path(path: str) -> str:
    """The reference path to compare `path` with (skipped, with the reason, where it cannot run)."""
    supported = KERNELS.supported_quant_paths()
    if path not in supported:
        pytest.skip(f"this CPU or build cannot run the {path} path (it runs {', '.join(supported)})")
    return supported[0]


class _Path:
    """with _Path(name): quantized linears run on `name` inside, and on the default path after."""

    def __init__(self, name: str, kernels: cpu_kernels.CpuKernels | None = None) -> None:
        self.kernels = kernels or KERNELS
        self.name, self.before = name, self.kernels.quant_path

    def __enter__(self) -> None:
        self.kernels.select_quant_path(self.name)

    def __exit__(self, *exc) -> None:
        self.kernels.select_quant_path(self.before)


def _assert_paths_agree(path: str, kernels: cpu_kernels.CpuKernels, ks, ns, ms, trials: int) -> None:
    """Random linears of int4 (both records) and int8 parts fused, K and N multiples of 32 but
    not of 256, padding tiles: `kernels` on `path` gives the reference path's bits."""
    reference = _on_path("vnni" if path == "amx" else path)
    rng = np.random.default_rng(3)
    g = torch.Generator().manual_seed(3)
    for _ in range(trials):
        k, n = int(rng.choice(ks)), int(rng.choice(ns))
        q4_0 = _q4_0_weight(rng.standard_normal((24, k)))
        parts = [quant.quantize(torch.randn(n, k, generator=g), 4),
                 quant.quantize(torch.randn(40, k, generator=g), 8), q4_0]
        plan = cpu_kernels.QuantPlan(parts)
        for m in sorted(set(ms) | {int(rng.integers(1, max(ms) + 1))}):
            x = torch.randn(m, k, generator=g) * float(rng.choice([0.01, 1.0, 40.0]))
            with _Path(reference):
                want = KERNELS.quant_linear(x, plan)
            with _Path(path, kernels):
                got = kernels.quant_linear(x, plan)
            assert torch.equal(got, want), f"[{m}, {k}] x [{n}+40+24, {k}] differs on {path} vs {reference}"


@pytest.mark.parametrize("path", PATHS)
def test_paths_are_bit_identical_on_random_shapes(path: str):
    """M from 1 to 600: every code path (narrow, widened, AMX's row tiles, the row-chunk edges)."""
    _on_path(path)
    _assert_paths_agree(path, KERNELS, [32, 96, 160, 480, 800, 2080], [40, 96, 224, 288, 1056],
                        [1, 2, 3, 4, 5, 11, 12, 13, 16, 17, 37, 600], trials=12)


@pytest.fixture(scope="module")
def emulated_amx() -> cpu_kernels.CpuKernels:
    """The kernels built with software tiles (QL_AMX_EMULATE): the AMX path's packing, tile
    shapes and epilogue, run where the CPU has AVX-512 VNNI but no AMX."""
    _on_path("vnni")
    return cpu_kernels.CpuKernels(ctypes.CDLL(str(cpu_kernels.build(("QL_AMX_EMULATE",)))))


def test_amx_path_in_software_tiles_is_bit_identical(emulated_amx: cpu_kernels.CpuKernels):
    """The AMX path with each tile instruction done in C (checking the shapes the hardware would
    fault on) gives the VNNI path's bits: 16-row tiles, a partial last one, 8-column groups."""
    assert "amx" in emulated_amx.supported_quant_paths()
    _assert_paths_agree("amx", emulated_amx, [32, 96, 160, 480], [8, 40, 96, 224], [16, 17, 31, 33, 70],
                        trials=6)


@pytest.mark.parametrize("path", PATHS)
def test_paths_give_the_same_forward(path: str, runners, prompts):
    """A whole forward of the embedded model (prefill chunks and decode rows in one batch, the
    compiled decoder's path) gives the same logits, bit for bit, on each path."""
    reference = _on_path(path)
    runner = runners["int4"]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(6)]
    prefill = [BatchItem(ids, 0, table, 0) for ids, table in zip(prompts, tables)]
    decode = [BatchItem([7], len(ids), table, 0) for ids, table in zip(prompts, tables)]
    with _Path(reference):
        want = [runner.forward(prefill), runner.forward(decode)]
    with _Path(path):
        assert runner.model.linear_kinds()["layers.0.qkv"] == f"int4/{path}"
        got = [runner.forward(prefill), runner.forward(decode)]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _q4_0_weight(w: np.ndarray, raw: np.ndarray | None = None) -> quant.QuantWeight:
    """w [n, k] as GGUF's Q4_0 blocks (or those given), packed as a Q4_0 file's tensor runs."""
    from gguf import GGMLQuantizationType, quants

    from unison.model.weights.gguf import _q4_0

    raw = quants.quantize(w.astype(np.float32), GGMLQuantizationType.Q4_0) if raw is None else raw
    return quant.pack(w.shape[0], w.shape[1], 4, lambda r0, r1: _q4_0(raw[r0:r1]), symmetric=True)


def test_q4_0_records_without_m_give_the_same_bits():
    """GGUF's Q4_0 runs in 144-byte records (m = -8 d, computed by the kernel): the same bits as
    160-byte records holding that m, on every path, at every row count's code path."""
    from gguf import GGMLQuantizationType, quants

    from unison.model.weights.gguf import _q4_0

    rng = np.random.default_rng(5)
    w = rng.standard_normal((72, 256))
    raw = quants.quantize(w.astype(np.float32), GGMLQuantizationType.Q4_0)

    def with_m(r0: int, r1: int) -> quant.BlockQuant:
        bq = _q4_0(raw[r0:r1])
        return quant.BlockQuant(4, bq.q, bq.d, bq.min())

    short = _q4_0_weight(w, raw)
    full = quant.pack(72, 256, 4, with_m)
    assert (short.format, full.format) == (144, 160) and short.nbytes == raw.nbytes
    ids = torch.arange(72)
    assert torch.equal(KERNELS.dequantize_rows(short, ids), KERNELS.dequantize_rows(full, ids))
    g = torch.Generator().manual_seed(5)
    for path in KERNELS.supported_quant_paths():
        with _Path(path):
            for m in (1, 3, 13, 40):  # narrow, VNNI widened (12+), AVX2 FMA and AMX (16+)
                x = torch.randn(m, 256, generator=g)
                got = KERNELS.quant_linear(x, cpu_kernels.QuantPlan([short]))
                assert torch.equal(got, KERNELS.quant_linear(x, cpu_kernels.QuantPlan([full]))), (path, m)


def test_forcing_a_path_the_cpu_lacks_is_a_clear_error():
    with pytest.raises(ValueError, match="UNISON_QUANT_KERNEL='sse9': expected auto or one of"):
        KERNELS.select_quant_path("sse9")
    missing = [p for p in ["avx2", *PATHS] if p not in KERNELS.supported_quant_paths()]
    for p in missing:
        with pytest.raises(ValueError, match="cannot run it"):
            KERNELS.select_quant_path(p)


def test_fused_parts_of_different_kinds():
    """q | k | v with v wider (as a GGUF's Q4_K_M may store it) and parts not a whole tile."""
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(n, 64, generator=g) for n in (20, 12, 12)]
    parts = [quant.quantize(ws[0], 4), quant.quantize(ws[1], 4), quant.quantize(ws[2], 8)]
    x = torch.randn(5, 64, generator=g)
    got = KERNELS.quant_linear(x, cpu_kernels.QuantPlan(parts))
    want = torch.cat([reference_matmul(x, p) for p in parts], dim=1)
    assert got.shape == (5, 44)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---- GGUF tensor types into the kernel's blocks ------------------------------------------------

def _blocks_of(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF rows of `kind`: through gguf's own quantizer where it has one, else random bytes
    with sane fp16 scales at the type's scale offsets (the K- and IQ-quants)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[kind]
    w = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
    if kind in ("F32", "F16"):
        return w.astype(np.float16 if kind == "F16" else np.float32)
    if kind in ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quantize(w, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for offset in _FP16_FIELDS[kind]:
        raw[..., offset: offset + 2] = (rng.uniform(1e-3, 4e-3, raw.shape[:2])
                                        .astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2))
    return raw.reshape(rows, -1)


_FP16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
                "IQ4_NL": [0], "IQ4_XS": [0]}
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "IQ4_NL", "IQ4_XS"]


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A small GGUF with one [24, 512] tensor of each type, written with the gguf package."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    w = GGUFWriter(path, "llama")
    raws = {}
    for i, kind in enumerate(TYPES):
        raws[kind] = _blocks_of(kind, 24, 512, rng)
        qtype = None if kind in ("F32", "F16") else GGMLQuantizationType[kind]
        w.add_tensor(f"blk.{i}.ffn_down.weight", raws[kind], raw_dtype=qtype)
    w.add_tensor("blk.99.ffn_up.weight", np.zeros((8, 40), np.uint8), raw_dtype=GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, raws


def _config() -> dict:
    return {"model_type": "llama", "num_attention_heads": 1, "num_key_value_heads": 1}


@pytest.mark.parametrize("kind", TYPES)
def test_every_gguf_type_runs_as_stored_or_is_refused(typed_gguf, kind: str):
    """Block formats and Q4_0 / Q4_1 keep llama.cpp's values exactly; float tensors quantize to
    int8 within half a step; Q2_K / Q3_K are refused by name (test_gguf_blocks.py: the rest)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path, raws = typed_gguf
    weights = GGUFWeights(path, _config())
    name = f"model.layers.{TYPES.index(kind)}.mlp.down_proj.weight"
    ref = (raws[kind].astype(np.float32) if kind in ("F32", "F16")
           else dequantize(raws[kind], GGMLQuantizationType[kind]))
    np.testing.assert_array_equal(weights.float(name).numpy(), ref)  # the float path: gguf's own
    bits = 4 if kind in quant.GGUF_INT4_TYPES else 8
    if kind in ("Q2_K", "Q3_K"):
        with pytest.raises(ValueError, match=f"has type {kind}, which Unison does not run"):
            weights.quantized(name, bits)
        return
    qw = weights.quantized(name, bits)
    got = KERNELS.dequantize_rows(qw, torch.arange(qw.n)).numpy()
    err = np.abs(got - ref).reshape(24, -1, 32)
    if kind not in ("F32", "F16", "BF16"):
        assert err.max() == 0, f"{kind} runs as llama.cpp's values exactly"
    else:  # quantized: half a step of the block's int8 scale
        step = np.abs(ref).reshape(24, -1, 32).max(axis=2, keepdims=True) / 127
        assert (err <= 0.5 * step * 1.002 + 1e-9).all(), f"{kind}: {err.max()} vs step {step.max()}"


def test_a_type_the_reader_cannot_read_is_a_clear_error(typed_gguf):
    weights = GGUFWeights(typed_gguf[0], _config())
    with pytest.raises(ValueError, match=r"'blk\.99\.ffn_up\.weight' has type Q8_1"):
        weights.quantized("model.layers.99.mlp.up_proj.weight", 8)


def test_embedded_file_converts_exactly():
    """SmolLM2's Q4_1 and Q8_0 tensors land in int4 and int8 without changing a value."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weights = GGUFWeights(default_gguf_path())
    seen = set()
    for name in sorted(weights.names()):
        kind = weights.source_type(name)
        if kind == "F32" or (kind in seen and "layers.0." not in name):
            continue
        seen.add(kind)
        qw = weights.quantized(name, 4 if kind == "Q4_1" else 8)
        t = weights.tensors[name]
        ref = dequantize(weights._rows(t), GGMLQuantizationType[kind])
        got = KERNELS.dequantize_rows(qw, torch.arange(qw.n)).numpy()
        np.testing.assert_array_equal(got, ref, err_msg=name)
    assert seen == {"Q4_1", "Q8_0"}


# ---- quality against the float32 path ----------------------------------------------------------

CHATS = ["What is the capital of Japan?", "Write a haiku about autumn leaves.",
         "Explain in one sentence why the sky is blue."]


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


BF16_UNITS = torch.cpu._is_avx512_bf16_supported()  # else oneDNN emulates bf16: slow, not tested


@pytest.fixture(scope="module")
def runners() -> dict[str, ModelRunner]:
    out = {q: ModelRunner(None, quantization=q, num_blocks=256) for q in ("none", "int8", "int4")}
    assert {q: r.quantization for q, r in out.items()} == {"none": "none", "int8": "int8", "int4": "int4"}
    if BF16_UNITS:  # vLLM's CPU dtype: float checkpoints' linears in bf16, the rest float32
        out["bfloat16"] = ModelRunner(None, quantization="none", dtype="bfloat16", num_blocks=256)
    return out


def _kind(runners: dict[str, ModelRunner], kind: str) -> ModelRunner:
    if kind not in runners:
        pytest.skip("this CPU has no bf16 units (AVX512-BF16 or AMX-BF16)")
    return runners[kind]


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    return [tok.encode(t) for t in TEXTS + chats]


@pytest.fixture(scope="module")
def fp32_greedy(runners, prompts):
    return greedy(runners["none"], prompts, 32)


@pytest.mark.parametrize("kind", ["int8", "int4", "bfloat16"])
def test_greedy_matches_fp32_up_to_a_near_tie(runners, prompts, fp32_greedy, kind: str):
    got = greedy(_kind(runners, kind), prompts, 32)
    for i, ((ref_ids, ref_top), (ids, tops)) in enumerate(zip(fp32_greedy, got)):
        assert_greedy_close(ref_ids, ref_top, ids, tops, name=f"{kind} prompt {i}", max_gap=QUALITY_GAP)


@pytest.mark.parametrize("kind", ["int8", "int4", "bfloat16"])
def test_first_step_logprobs_near_fp32(runners, prompts, fp32_greedy, kind: str):
    runner = _kind(runners, kind)
    blocks = Blocks(runner)
    worst = 0.0
    for prompt, (_, ref_top) in zip(prompts, fp32_greedy):
        logits = runner.forward([BatchItem(prompt, 0, blocks.table(len(prompt)), len(prompt) - 1)])
        logprobs = torch.log_softmax(logits[0], dim=-1)
        worst = max(worst, *(abs(logprobs[t].item() - lp) for t, lp in ref_top[0].items()))
    print(f"\n[figure] {kind}: largest first-step top-5 logprob difference from fp32: {worst:.4f}")
    assert worst < 0.15


def _loglikelihoods(runner: ModelRunner, tok: Tokenizer, items: list[dict]) -> list[tuple[float, int]]:
    """(log p(choice | question), choice tokens) for every choice, as lm-eval scores them."""
    seqs = []
    for item in items:
        ctx = tok.encode(f"Question: {item['q']}\nAnswer:")
        seqs += [(ctx, tok.encode(" " + c)) for c in item["choices"]]
    out = []
    for i in range(0, len(seqs), 40):
        chunk = seqs[i: i + 40]
        blocks = Blocks(runner)
        batch = [BatchItem(c + a, 0, blocks.table(len(c) + len(a)), len(c) - 1) for c, a in chunk]
        logits = torch.log_softmax(runner.forward(batch), dim=-1)
        row = 0
        for _, cont in chunk:
            rows = logits[row: row + len(cont)]  # rows predict the choice's tokens
            out.append((rows.gather(1, torch.tensor(cont)[:, None]).sum().item(), len(cont)))
            row += len(cont) + 1
    return out


@pytest.mark.parametrize("kind", ["int8", "int4", "bfloat16"])
def test_multiple_choice_answers_match_fp32(runners, tok, kind: str):
    items = QUIZ
    assert len(items) == 40
    ref, got = _loglikelihoods(runners["none"], tok, items), _loglikelihoods(_kind(runners, kind), tok, items)
    per_token = [abs(a - b) / n for (a, n), (b, _) in zip(ref, got)]
    same = sum(int(np.argmax([ll for ll, _ in ref[4 * i: 4 * i + 4]]) ==
                   np.argmax([ll for ll, _ in got[4 * i: 4 * i + 4]])) for i in range(40))
    print(f"\n[figure] {kind}: {same}/40 answers as fp32; mean |d loglik| "
          f"{np.mean(per_token):.4f} nats per token")
    assert same >= 37
    assert np.mean(per_token) <= 0.05


@pytest.mark.skipif(not BF16_UNITS, reason="this CPU has no bf16 units (AVX512-BF16 or AMX-BF16)")
def test_bfloat16_on_cpu_runs_the_linears_in_bf16(runners):
    """dtype=bfloat16 on CPU: linears as bf16 (half the bytes), everything else float32 on the C
    kernels, a bf16 KV cache; a quantized checkpoint cannot be combined with it."""
    bf16, fp32 = runners["bfloat16"], runners["none"]
    kinds = bf16.model.linear_kinds()
    assert kinds["layers.0.qkv"] == kinds["lm_head"] == "bfloat16" and kinds["embed_tokens"] == "float32"
    assert bf16.model.dtype == torch.float32 and bf16.kv_dtype == torch.bfloat16
    assert isinstance(bf16.model.ops, cpu_kernels.CpuKernels)
    assert bf16.model.weights_bytes() < 0.75 * fp32.model.weights_bytes()
    with pytest.raises(ValueError, match="quantization='int4' computes in float32 on CPU"):
        ModelRunner(None, quantization="int4", dtype="bfloat16", num_blocks=16)


def test_quantization_on_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="quantization 'int8' runs on CPU only"):
        EngineConfig(device="cuda", quantization="int8")
    assert EngineConfig(device="cuda").quantization == "auto"  # auto keeps bf16 there


@pytest.mark.parametrize("kind", ["qwen2-qkv-bias", "qwen3-qk-norm", "gemma3-window-across-chunks",
                                  "olmo2-post-norms"])
def test_compiled_forward_is_the_python_forward(kind: str, tmp_path: Path):
    """Quantized models run each step as one C call (csrc/decoder.c): the same kernels in the
    same order as decoder.py's forward, so the logits are bit-identical, family by family."""
    from tests.unit.test_model import tiny_model

    tiny_model(kind, tmp_path)
    runner = ModelRunner(tmp_path, quantization="int4", num_blocks=16, block_size=4)
    assert runner._compiled is not None
    ids = torch.randint(0, 256, (30,)).tolist()
    batch = [BatchItem(ids[:13], 0, [0, 1, 2, 3], 0), BatchItem(ids[:20], 0, list(range(4, 9)), 18)]
    compiled = runner.forward(batch)
    runner._compiled, kept = None, runner._compiled
    try:
        assert torch.equal(runner.forward(batch), compiled)
    finally:
        runner._compiled = kept
