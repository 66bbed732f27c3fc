"""`unison bench kernels`: the model's linears summed (every layer's four and the LM head; or the
LM head alone, `--lm-head`), timed at several batch sizes M on each int4 instruction-set path this
CPU runs, beside oneDNN's fp32 (and bf16, on CPUs with bf16 units) GEMMs of the same model. Best of
`--reps` per cell: the kernel table of BENCHMARKS.md. `--attention`: one decode row's paged
attention over a long context instead (the KV cache's share of a decode step at 8,000 tokens)."""

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
    from unison.model.kernels import cpu_kernels

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


ATTENTION_LAYERS = 6  # more caches than the last-level cache holds at 8,000 keys: rows come from memory


def attention(args: argparse.Namespace) -> int:
    """One decode row over `--keys` cached tokens, the caches of ATTENTION_LAYERS layers taken in
    turn (so their rows come from memory, as a decode step's layers read them); median and best."""
    import time

    import torch

    from unison.model.kernels import cpu_kernels
    from unison.model.layers.attention import kv_head_bytes
    from unison.model.runner import resolve_kv_dtype

    kernels = cpu_kernels.load()
    if kernels is None:
        print("no C compiler here: no attention kernel to time")
        return 1
    g = torch.Generator().manual_seed(0)
    bs, d, kv = 16, args.head_dim, args.kv_heads
    blocks = -(-args.keys // bs)
    dtype = resolve_kv_dtype(args.kv_cache_dtype, torch.float32, "int4")
    width = kv_head_bytes(d, dtype) // dtype.itemsize
    layers = []
    for _ in range(ATTENTION_LAYERS):  # keys that share a direction, as real keys do
        k = torch.randn(blocks * bs, kv * d, generator=g) + 3 * torch.randn(1, kv * d, generator=g)
        v = torch.randn(blocks * bs, kv * d, generator=g)
        kc = torch.zeros(blocks, bs, kv, width, dtype=dtype)
        vc = torch.zeros_like(kc)
        kernels.store_kv(k, v, kc, vc, torch.arange(blocks * bs), d)
        layers.append((kc, vc))
    table = torch.randperm(blocks, generator=g).view(1, -1)  # blocks anywhere in the pool
    q = torch.randn(1, args.heads, d, generator=g)
    row_seq, row_len = torch.zeros(1, dtype=torch.int64), torch.tensor([args.keys])
    threads = args.num_threads or torch.get_num_threads()
    times = []
    for i in range(args.reps * ATTENTION_LAYERS):
        kc, vc = layers[i % ATTENTION_LAYERS]
        start = time.perf_counter()
        kernels.paged_attention(q, kc, vc, table, row_seq, row_len, None, threads)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"one decode row over {args.keys} keys, {args.heads} heads of {d} ({kv} KV heads), "
          f"{args.kv_cache_dtype} cache, {threads} threads: median {times[len(times) // 2] * 1e3:.3f} ms, "
          f"best {times[0] * 1e3:.3f} ms ({len(times)} calls over {ATTENTION_LAYERS} layers' caches)")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kernels", help="the model's linears per int4 path beside oneDNN fp32 / bf16")
    p.add_argument("--model-path", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument("--m", default="1,16,64,512", help="batch sizes (rows), comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--lm-head", action="store_true", help="time the LM head alone (int8 where the "
                   "checkpoint's embedding is tied and 8-bit)")
    p.add_argument("--attention", action="store_true", help="time one decode row's paged attention "
                   "instead (the options below)")
    p.add_argument("--keys", type=int, default=8000, help="--attention: cached tokens")
    p.add_argument("--heads", type=int, default=16, help="--attention: query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="--attention: KV heads")
    p.add_argument("--head-dim", type=int, default=256, help="--attention: head size")
    p.add_argument("--kv-cache-dtype", default="int8", help="--attention: the cache's type")
    p.set_defaults(func=lambda args: attention(args) if args.attention else main(args))
