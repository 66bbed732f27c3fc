"""`unison bench kernels`: the model's linears summed (every layer's four and the LM head; or the
LM head alone, `--lm-head`), timed at several batch sizes M on each int4 instruction-set path this
CPU runs, beside oneDNN's fp32 (and bf16, on CPUs with bf16 units) GEMMs of the same model. Best of
`--reps` per cell: the kernel table of BENCHMARKS.md."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the model load when the command runs
    from unison.model.decoder import DecoderModel
    from unison.model.runner import ModelRunner


def _runner(model_path: str | None, quantization: str, dtype: str = "auto") -> ModelRunner:
    from unison.model.runner import ModelRunner

    return ModelRunner(model_path, num_blocks=1, quantization=quantization, dtype=dtype)


def main(args: argparse.Namespace) -> int:
    import torch  # here, not at import: the CLI builds every command's parser, `serve`'s too

    from unison.bench.ceiling import linears_time, lm_head_time
    from unison.model import cpu_kernels

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    sizes = [int(m) for m in args.m.split(",")]
    kernels = cpu_kernels.load()
    if kernels is None:
        print("no C compiler here: no int4 kernels to time")
        return 1
    columns: dict[str, list[float]] = {}

    def times(model: DecoderModel) -> list[float]:
        if args.lm_head:
            return [lm_head_time(model, m, args.reps) for m in sizes]
        return [linears_time(model, Counter({(m, m): 1}), args.reps) for m in sizes]

    quantized = _runner(args.model_path, "int4").model
    for path in kernels.supported_quant_paths():
        kernels.select_quant_path(path)
        columns[f"int4/{path}"] = times(quantized)
    kernels.select_quant_path("auto")
    del quantized
    floats = {"fp32": "auto"}  # each column's dtype ("auto": float32 on the CPU)
    if torch.cpu._is_avx512_bf16_supported():
        floats["bf16"] = "bfloat16"
    for name, dtype in floats.items():
        columns[name] = times(_runner(args.model_path, "none", dtype).model)
    names = list(columns)
    what = "the LM head" if args.lm_head else "linears"
    print(f"{what} of {args.model_path or 'the embedded model'}, summed, ms (best of {args.reps}); "
          f"x = fp32's time over this one's, {torch.get_num_threads()} threads")
    print(f"{'M':>6}" + "".join(f"{n:>22}" for n in names))
    for i, m in enumerate(sizes):
        base = columns["fp32"][i]
        cells = [f"{columns[n][i] * 1e3:10.2f} ({base / columns[n][i]:5.2f}x)" for n in names]
        print(f"{m:>6}" + "".join(f"{c:>22}" for c in cells))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kernels", help="the model's linears per int4 path beside oneDNN fp32 / bf16")
    p.add_argument("--model-path", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument("--m", default="1,16,64,512", help="batch sizes (rows), comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--lm-head", action="store_true", help="time the LM head alone (int8 where the "
                   "checkpoint's embedding is tied and 8-bit)")
    p.set_defaults(func=main)
