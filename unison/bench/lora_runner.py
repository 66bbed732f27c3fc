"""`unison bench lora-runner`: LoRA at the model runner, decode steps with adapters against the base
model's, and load time.

    unison bench lora-runner [--model PATH] [--rank 16] [--repeats 15]

Prints, for decode steps of 1 and 64 rows at 128 tokens of context, the step time on the base
model, with every row on one rank-16 adapter over all seven modules, and with four adapters mixed
(rows round-robin), as medians of interleaved repeats; each as a ratio of the base's throughput.
And the median time to read a PEFT adapter and make it runnable (read_peft + add_lora).
Adapters are random, written in PEFT's layout (no peft needed): `unison bench lora`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from unison.bench.lora import write_adapter

if TYPE_CHECKING:  # torch and the runner load inside main: the CLI imports this module for --help
    from unison.model.runner import BatchItem, ModelRunner

CONTEXT = 128


def decode_batch(runner: ModelRunner, rows: int, adapters: list[int]) -> list[BatchItem]:
    """`rows` requests with CONTEXT tokens cached, each decoding one token (adapters round-robin)."""
    import torch

    from unison.model.runner import BatchItem

    per = -(-(CONTEXT + 1) // runner.block_size)
    g = torch.Generator().manual_seed(rows)
    batch = []
    for i in range(rows):
        table = list(range(i * per, (i + 1) * per))
        prompt = torch.randint(0, runner.vocab_size, (CONTEXT,), generator=g).tolist()
        runner.forward([BatchItem(prompt, 0, table, CONTEXT)])
        batch.append(BatchItem([prompt[-1]], CONTEXT, table, 0, adapters[i % len(adapters)]))
    return batch


def step_times(runner: ModelRunner, batches: dict[str, list[BatchItem]], repeats: int) -> dict[str, float]:
    """Median seconds per forward of each batch, the batches interleaved so drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in batches}
    for batch in batches.values():  # warm
        runner.forward(batch)
    for _ in range(repeats):
        for name, batch in batches.items():
            start = time.perf_counter()
            runner.forward(batch)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(args: argparse.Namespace) -> int:
    import torch

    from unison.model.layers.lora import read_peft
    from unison.model.runner import ModelRunner

    runner = ModelRunner(args.model, quantization=args.quantization, num_blocks=64 * 10 + 16)
    print(f"model: {runner.model_dir.name}, linears {runner.quantization}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", runner.model_dir, args.rank, i, b_std=0.01)
                 for i in range(4)]
        loads = []
        for i in range(5):
            start = time.perf_counter()
            weights = read_peft(paths[0], runner.config, args.rank)
            runner.add_lora(100 + i, weights)
            loads.append(time.perf_counter() - start)
            runner.remove_lora(100 + i)
        print(f"load (read_peft + add_lora), rank {args.rank}, all 7 modules, {weights.nbytes / 1e6:.1f} MB: "
              f"median {statistics.median(loads) * 1000:.0f} ms")
        for i, path in enumerate(paths):
            runner.add_lora(i + 1, read_peft(path, runner.config, args.rank))
    for rows in (1, 64):
        base = decode_batch(runner, rows, [0])
        batches = {"base": base, "one adapter": [_on(b, 1) for b in base],
                   "4 adapters": [_on(b, 1 + i % 4) for i, b in enumerate(base)]}
        if rows == 1:
            del batches["4 adapters"]
        t = step_times(runner, batches, args.repeats)
        for name, seconds in t.items():
            print(f"decode {rows:2d} rows, {name:12s}: {seconds * 1000:7.2f} ms/step, "
                  f"{rows / seconds:7.1f} tok/s, {t['base'] / seconds:.3f}x base")
    return 0


def _on(item: BatchItem, adapter: int) -> BatchItem:
    return dataclasses.replace(item, adapter=adapter)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("lora-runner", help="LoRA in the model runner alone: decode steps, load time")
    p.add_argument("--model", default=None, help="model path (default: the embedded model)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.set_defaults(func=main)
