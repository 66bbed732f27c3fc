"""LoRA at the model runner: decode steps with adapters against the base model's, and load time.

    python benchmarks/lora_runner.py [--model PATH] [--rank 16] [--repeats 15]

Prints, for decode steps of 1 and 64 rows at 128 tokens of context, the step time on the base
model, with every row on one rank-16 adapter over all seven modules, and with four adapters mixed
(rows round-robin), as medians of interleaved repeats; each as a ratio of the base's throughput.
And the median time to read a PEFT adapter and make it runnable (read_peft + add_lora).
Adapters are random, written in PEFT's layout (no peft needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from unison.model.lora import LORA_TARGETS, module_shapes, read_peft
from unison.model.runner import BatchItem, ModelRunner

CONTEXT = 128


def write_adapter(out: Path, runner: ModelRunner, rank: int, seed: int) -> Path:
    """A random rank-`rank` adapter over every target module, as peft's save_pretrained writes it."""
    g, cfg = torch.Generator().manual_seed(seed), runner.config
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (n_in, n_out) in module_shapes(cfg).items():
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS),
        "bias": "none"}))
    return out


def decode_batch(runner: ModelRunner, rows: int, adapters: list[int]) -> list[BatchItem]:
    """`rows` requests with CONTEXT tokens cached, each decoding one token (adapters round-robin)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    runner = ModelRunner(args.model, quantization=args.quantization, num_blocks=64 * 10 + 16)
    print(f"model: {runner.model_dir.name}, linears {runner.quantization}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", runner, args.rank, i) for i in range(4)]
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


def _on(item: BatchItem, adapter: int) -> BatchItem:
    return BatchItem(item.token_ids, item.start_pos, item.block_table, item.logits_start, adapter)


if __name__ == "__main__":
    main()
