"""`unison bench speculative`: the same workloads with speculative decoding off and on, in one run.

Workloads: input-grounded single streams (repeat / fix / extract / reformat, bench/datasets.py),
random-token single streams (drafts fail), and N concurrent random requests (offline throughput).
Each trial runs both engines back to back; the table gives medians over trials, the ratio on/off
and the acceptance rate (accepted / drafted tokens) and mean accepted tokens per draft.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass

import msgspec

from unison import Engine
from unison.bench.datasets import GROUNDED_KINDS, SampleRequest, grounded_prompt, random_requests
from unison.bench.offline import (
    SamplingParams,
    add_engine_arguments,
    engine_options,
    generate_all,
    random_prompts,
    timed_stream,
    unison_throughput,
)
from unison.core.metrics import RECORD_STEP_SHAPES_ENV
from unison.wire.messages import ServerInfo

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}


def decode_rate(engine: Engine, prompts: list[list[int]], output_len: int, lora: str | None = None,
                ignore_eos: bool = False) -> float:
    """Single-stream decode tok/s over the prompts, one at a time (first token excluded)."""
    tokens, seconds = 0, 0.0
    params: SamplingParams = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": ignore_eos}
    for ids in prompts:
        first, last, n = timed_stream(engine, ids, params, lora)
        if n > 1:
            tokens, seconds = tokens + n - 1, seconds + (last - first)
    return tokens / seconds


def batch_rate(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of the prompts submitted together."""
    t0 = time.perf_counter()
    greedy: SamplingParams = {"temperature": 0, "max_new_tokens": output_len}
    outs = generate_all(engine, prompts, greedy)
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)


def spec_counts(engine: Engine) -> tuple[int, int, int]:
    spec = engine.server_info().stats.spec_decode
    if spec is None:
        return 0, 0, 0
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens


@dataclass
class Workloads:
    prompts: dict[str, list[list[int]]]  # grounded, random, grounded@N: token ids
    offline: list[SampleRequest]


def measure(engine: Engine, workload: str, args: argparse.Namespace, data: Workloads) -> dict[str, float]:
    before = spec_counts(engine)
    if workload == "offline":
        rate = unison_throughput(engine, data.offline, quiet=True)["output_tok_s"]
    elif "@" in workload:
        rate = batch_rate(engine, data.prompts[workload], args.output_len)
    else:
        rate = decode_rate(engine, data.prompts[workload], args.output_len)
    drafts, drafted, accepted = (b - a for a, b in zip(before, spec_counts(engine)))
    return {"tok_s": rate, "acceptance": accepted / drafted if drafted else 0.0,
            "per_draft": accepted / drafts if drafts else 0.0}


def workloads(engine: Engine, args: argparse.Namespace) -> Workloads:
    tok = engine.tokenizer
    rng = random.Random(args.seed)
    vocab = engine.server_info().core.vocab_size
    grounded = [tok.apply_chat_template([{"role": "user", "content": grounded_prompt(kind, rng)}])
                for kind in GROUNDED_KINDS]
    ids = [tok.encode(p, add_special_tokens=False) for p in grounded]
    batches = {w: [ids[i % len(ids)] for i in range(int(w.split("@")[1]))]
               for w in args.workloads.split(",") if w.startswith("grounded@")}
    return Workloads({**batches, "grounded": ids,
                      "random": random_prompts(len(GROUNDED_KINDS), args.prompt_len, vocab, args.seed)},
                     random_requests(args.num_prompts, args.prompt_len, args.output_len, 0.0, args.seed,
                                     vocab=vocab))


def main(args: argparse.Namespace) -> int:
    os.environ[RECORD_STEP_SHAPES_ENV] = "1"  # the offline workload reads the step shapes
    opts = engine_options(args)
    given = opts.pop("speculative_config", None)  # the "on" engine's; "off" has none
    spec = json.loads(given) if given else DEFAULT_SPEC
    engines = {"off": Engine(**opts), "on": Engine(**opts, speculative_config=spec)}
    try:
        data = workloads(engines["off"], args)
        for e in engines.values():  # warm both
            e.generate(input_ids=data.prompts["grounded"][0],
                       sampling_params={"temperature": 0, "max_new_tokens": 8})
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.trials):
            for workload in args.workloads.split(","):
                for mode, engine in engines.items():
                    engine.flush_cache()
                    run = measure(engine, workload, args, data)
                    runs.setdefault((workload, mode), []).append(run)
                    print(f"{workload} {mode}: {run['tok_s']:.1f} tok/s, acceptance {run['acceptance']:.2f}",
                          flush=True)
        info = engines["on"].server_info()
    finally:
        for e in engines.values():
            e.shutdown()
    print(report(runs, args, info))
    return 0


def report(runs: dict[tuple[str, str], list[dict[str, float]]], args: argparse.Namespace,
           info: ServerInfo) -> str:
    lines = [f"speculative_config: {msgspec.json.encode(info.config.speculative_config).decode()}; "
             f"linears: {info.core.quantization}; medians of {args.trials} trials",
             f"{'workload':<12}{'off tok/s':>11}{'on tok/s':>11}{'on/off':>9}{'accepted':>10}"
             f"{'per draft':>11}"]
    for workload in args.workloads.split(","):
        off = statistics.median(r["tok_s"] for r in runs[(workload, "off")])
        on_runs = runs[(workload, "on")]
        on = statistics.median(r["tok_s"] for r in on_runs)
        acc = statistics.median(r["acceptance"] for r in on_runs)
        per = statistics.median(r["per_draft"] for r in on_runs)
        lines.append(f"{workload:<12}{off:>11.1f}{on:>11.1f}{on / off:>8.2f}x{acc:>10.2f}{per:>11.2f}")
        lines.append("  trials off: " + ", ".join(f"{r['tok_s']:.1f}" for r in runs[(workload, 'off')])
                     + "; on: " + ", ".join(f"{r['tok_s']:.1f}" for r in on_runs))
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("speculative", help="speculative decoding off and on: single streams and a batch")
    add_engine_arguments(p)  # its --speculative-config is the "on" engine's (default: DEFAULT_SPEC)
    p.add_argument("--workloads", default="grounded,random,offline",
                   help="comma-separated: grounded, random (single streams, in turn), grounded@N (N "
                        "grounded requests at once), offline (--num-prompts random requests at once)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128, help="random prompts' length")
    p.add_argument("--num-prompts", type=int, default=64, help="offline: requests submitted at once")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
