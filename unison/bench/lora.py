"""`unison bench lora`: the base model and LoRA adapters in one engine, in one run.

Workloads, each trial running them back to back in the same engine (medians over trials):
  offline   N requests at once: all on the base model, all on one adapter, and K adapters mixed
            (request i on adapter i % K, so every step holds all K)
  single    one stream's decode tok/s (first token excluded): the base model, then one adapter
  load      seconds for load_lora_adapter of a rank-R adapter over all seven modules (a round
            trip from this process: reading PEFT's files and preparing the weights in the core)
The adapters are written in PEFT's format (adapter_config.json + adapter_model.safetensors) with
seeded random weights over q/k/v/o/gate/up/down, so the command needs no peft.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from unison import Engine
from unison.bench.datasets import SampleRequest, random_requests
from unison.bench.offline import add_engine_arguments, engine_options, token_ids, unison_throughput
from unison.bench.speculative import decode_rate
from unison.core.metrics import RECORD_STEP_SHAPES_ENV
from unison.wire.messages import ServerInfo

# model/layers/lora.py's LORA_TARGETS, spelled here: importing that module imports torch, and the CLI
# imports this one for its --help.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, model_dir: str | Path, rank: int, seed: int,
                  targets: tuple[str, ...] = TARGETS, b_std: float = 1e-3) -> Path:
    """A PEFT LoRA adapter of the model in `model_dir` over `targets`, seeded random: A scaled
    to keep x A near x's size, B's entries of std `b_std` (PEFT starts B at zero)."""
    import torch
    from safetensors.torch import save_file

    from unison.model.families import ModelConfig
    from unison.model.layers.lora import module_shapes

    cfg = ModelConfig.from_dir(model_dir)
    shapes = module_shapes(cfg)  # (in, out) of each target
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name in targets:
            (fan_in, fan_out), part = shapes[name], "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * b_std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "bias": "none", "use_rslora": False, "lora_dropout": 0.0}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def run_trial(engine: Engine, args: argparse.Namespace, reqs: list[SampleRequest], names: list[str],
              prompts: list[list[int]], adapter_dir: Path) -> dict[str, float]:
    n, fig, workloads = len(reqs), {}, args.workloads.split(",")
    if "offline" in workloads:
        fig["offline base"] = unison_throughput(engine, reqs)["output_tok_s"]
        fig["offline 1 adapter"] = unison_throughput(engine, reqs, loras=[names[0]] * n)["output_tok_s"]
        fig[f"offline {len(names)} adapters"] = unison_throughput(
            engine, reqs, loras=[names[i % len(names)] for i in range(n)])["output_tok_s"]
    if "single" in workloads:
        fig["single base"] = decode_rate(engine, prompts, args.output_len, ignore_eos=True)
        fig["single 1 adapter"] = decode_rate(engine, prompts, args.output_len, names[0], ignore_eos=True)
    if "load" in workloads:
        t0 = time.perf_counter()
        loaded = engine.load_lora_adapter("timed", str(adapter_dir))
        fig["load s"] = time.perf_counter() - t0
        assert loaded, loaded.message
        engine.unload_lora_adapter("timed")
    return fig


def main(args: argparse.Namespace) -> int:
    os.environ[RECORD_STEP_SHAPES_ENV] = "1"  # unison_throughput reads the step shapes
    names = [f"adapter{i}" for i in range(args.num_adapters)]
    with tempfile.TemporaryDirectory(prefix="unison-bench-lora-") as tmp, \
            Engine(**engine_options(args), enable_lora=True, max_lora_rank=args.rank,
                   max_loras_per_batch=args.num_adapters) as engine:
        info = engine.server_info()
        dirs = [write_adapter(Path(tmp) / name, info.core.model_dir, args.rank, seed)
                for seed, name in enumerate(names)]
        for name, path in zip(names, dirs):
            assert engine.load_lora_adapter(name, str(path)), name
        timed = write_adapter(Path(tmp) / "timed", info.core.model_dir, args.rank, 99)
        vocab = info.core.vocab_size
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, args.seed, vocab=vocab)
        prompts = [token_ids(r) for r in reqs[: args.single_streams]]
        trials = []
        for t in range(args.trials):
            trials.append(run_trial(engine, args, reqs, names, prompts, timed))
            print(f"trial {t + 1}: " + ", ".join(f"{k} {v:.3g}" for k, v in trials[-1].items()), flush=True)
    print(report(trials, args, info))
    return 0


def report(trials: list[dict[str, float]], args: argparse.Namespace, info: ServerInfo) -> str:
    """Medians over trials; each ratio is the median of the trials' own ratios (a trial runs the
    base and the adapters back to back, so the machine's drift between trials cancels)."""
    lines = [f"linears: {info.core.quantization}; adapters: rank {args.rank} over {', '.join(TARGETS)}; "
             f"offline: {args.num_prompts} x {args.input_len}/{args.output_len}; "
             f"medians of {len(trials)} trials",
             f"{'workload':<24}{'tok/s':>10}{'over base':>11}   per trial"]
    for key in trials[0]:
        if key == "load s":
            continue
        base = "offline base" if key.startswith("offline") else "single base"
        ratios = [t[key] / t[base] for t in trials]
        lines.append(f"{key:<24}{statistics.median(t[key] for t in trials):>10.1f}"
                     f"{statistics.median(ratios):>10.2f}x   {', '.join(f'{r:.2f}' for r in ratios)}")
    if "load s" in trials[0]:
        loads = [t["load s"] for t in trials]
        lines.append(f"load a rank-{args.rank} adapter: {statistics.median(loads):.3f} s "
                     f"(trials: {', '.join(f'{x:.3f}' for x in loads)})")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("lora", help="LoRA adapters beside the base model: batches, a stream, load time")
    add_engine_arguments(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=4, help="adapters mixed in the offline workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-streams", type=int, default=2, help="prompts decoded one at a time")
    p.add_argument("--workloads", default="offline,single,load",
                   help="comma-separated: offline, single, load")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
