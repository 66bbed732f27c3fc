"""GGUF block formats run as stored (model/weights/gguf_blocks.py, csrc/gguf_blocks.h): llama.cpp's exact
values, the file's own bytes, the same bits on every path and in every batch, and refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_quant import reference_matmul
from unison.model.kernels import cpu_kernels
from unison.model.weights import gguf_blocks
from unison.model.weights.gguf import GGUFWeights

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here: no quantized kernels")
BLOCK_TYPES = list(gguf_blocks.FORMATS)
# The fp16 fields of each type's file block (random bytes elsewhere): d, and dmin / m where it has one.
FP16_AT = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2],
           "IQ4_NL": [0], "IQ4_XS": [0], "Q2_K": [80, 82], "Q3_K": [108], "MXFP4": []}
E8M0_AT = {"MXFP4": 0}  # an e8m0 exponent byte: sane scales, and e = 0, 1 (subnormal) in the first row


def random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows of `kind`: every bit pattern of the values, scales and mins, sane fp16 d."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for at in FP16_AT[kind]:
        d = rng.uniform(1e-3, 4e-3, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., at: at + 2] = d.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if kind in E8M0_AT:
        raw[..., E8M0_AT[kind]] = rng.integers(117, 124, raw.shape[:2])
        raw[0, :2, E8M0_AT[kind]] = [0, 1]
    return raw.reshape(rows, -1)


def llama_values(kind: str, raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantization, as the gguf package implements it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[kind])


def packed(kind: str, raw: np.ndarray):
    rows = raw.shape[0]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return gguf_blocks.pack(kind, rows, raw.shape[1] // size * block, lambda r0, r1: raw[r0:r1])


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_values_are_llama_cpps_bit_for_bit_at_the_files_bytes(kind: str):
    """Every weight the kernel computes with is the float llama.cpp dequantizes (no scale
    rounded, nothing requantized), and the records take exactly the file's bytes."""
    raw = random_blocks(kind, 24, 512)
    weight = packed(kind, raw)
    got = KERNELS.dequantize_rows(weight, torch.arange(24)).numpy()
    np.testing.assert_array_equal(got, llama_values(kind, raw))
    assert weight.nbytes == raw.nbytes and weight.kind == kind.lower()
    odd = packed(kind, raw[:13])  # rows not a whole tile: zero rows pad it, and read as zero
    np.testing.assert_array_equal(KERNELS.dequantize_rows(odd, torch.arange(13)).numpy(), got[:13])


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_kernel_equals_reference_matmul(kind: str):
    raw = random_blocks(kind, 40, 768, seed=1)
    weight = packed(kind, raw)
    plan = cpu_kernels.QuantPlan([weight])
    g = torch.Generator().manual_seed(2)
    for m in (1, 2, 3, 5, 70):
        x = torch.randn(m, 768, generator=g) * torch.logspace(-2, 1, 768)  # outlier channels
        got, want = KERNELS.quant_linear(x, plan), reference_matmul(x, weight)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"{kind} m={m}: relative error {err:.2e}"


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_same_bits_on_every_path_alone_or_batched(kind: str, emulated_amx: cpu_kernels.CpuKernels):
    """Each row alone and in a batch of 37 (one outlier row), at 1 and 2 threads, on AVX2, VNNI
    and AMX (in software tiles, which run the VNNI kernels for these formats): one answer."""
    raw = random_blocks(kind, 48, 512, seed=3)
    plan = cpu_kernels.QuantPlan([packed(kind, raw)])
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(4))
    x[5] *= 50
    threads = torch.get_num_threads()
    outs = []
    try:
        for kernels in (KERNELS, emulated_amx):
            for path in kernels.supported_quant_paths():
                kernels.select_quant_path(path)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    outs.append(kernels.quant_linear(x, plan))
                    outs.append(torch.cat([kernels.quant_linear(x[i: i + 1], plan) for i in range(37)]))
    finally:
        torch.set_num_threads(threads)
        for kernels in (KERNELS, emulated_amx):
            kernels.select_quant_path("auto")
    assert len(outs) >= 8 and all(torch.equal(outs[0], o) for o in outs)


@pytest.fixture(scope="module")
def emulated_amx() -> cpu_kernels.CpuKernels:
    import ctypes

    return cpu_kernels.CpuKernels(ctypes.CDLL(str(cpu_kernels.build(("QL_AMX_EMULATE",)))))


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(path, "llama")
    for name, (raw, kind) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CONFIG = {"model_type": "llama", "num_attention_heads": 1, "num_key_value_heads": 1}


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K"])
def test_a_type_that_does_not_run_is_refused_by_name(kind: str, tmp_path: Path):
    path = _write(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (random_blocks(kind, 8, 256), kind),
                                        "blk.0.ffn_up.weight": (random_blocks("Q4_K", 8, 256), "Q4_K")})
    weights = GGUFWeights(path, CONFIG)
    with pytest.raises(ValueError, match=rf"'blk\.0\.ffn_down\.weight' has type {kind}, which Unison does "
                                         r"not run; the types that run are F32, .*Q4_K.*IQ4_XS"):
        weights.check_runnable()
    with pytest.raises(ValueError, match=rf"'blk\.0\.ffn_down\.weight' has type {kind}"):
        weights.quantized("model.layers.0.mlp.down_proj.weight", 4)
    assert weights.quantized("model.layers.0.mlp.up_proj.weight", 4).kind == "q4_k"


def test_a_truncated_block_tensor_is_refused_by_name(tmp_path: Path):
    path = _write(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (random_blocks("Q6_K", 8, 512), "Q6_K")})
    data = path.read_bytes()
    path.write_bytes(data[:-300])
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' runs past the end"):
        GGUFWeights(path, CONFIG)
