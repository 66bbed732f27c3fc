"""Prefix cache: TTFT with a cached 1,024-token prefix vs a cold one, and the throughput of 64
requests sharing a 512-token system prompt with the cache on vs off, in one invocation."""

from __future__ import annotations

import argparse
import statistics
import time

from unison import Engine
from unison.bench.offline import add_engine_arguments, engine_options, generate_all, random_prompts, stream


def _ttft(engine: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    for _ in stream(engine, ids, {"max_new_tokens": 1, "temperature": 0}):
        break
    return time.perf_counter() - t0


def ttft_pair(engine: Engine, prefix_len: int, vocab: int, seed: int, runs: int) -> tuple[float, float]:
    cold, warm = [], []
    for r in range(runs):
        prefix, q1, q2 = random_prompts(3, prefix_len, vocab, seed + r)
        engine.flush_cache()
        cold.append(_ttft(engine, prefix + q1[:16]))  # computes and caches the prefix
        warm.append(_ttft(engine, prefix + q2[:16]))  # reuses it
    return statistics.median(cold), statistics.median(warm)


def shared_prompt_throughput(engine: Engine, system_len: int, n: int, output_len: int, vocab: int,
                             seed: int) -> float:
    system, *questions = random_prompts(n + 1, system_len, vocab, seed)
    engine.flush_cache()
    prompts = [system + q[:32] for q in questions]
    t0 = time.perf_counter()
    outs = generate_all(engine, prompts, {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t0)


def main(args: argparse.Namespace) -> int:
    opts = {**engine_options(args), "chunked_prefill_size": 1024}
    results: dict[bool, float] = {}  # tok/s with the cache on, off
    cold = warm = 0.0
    for cache_on in (True, False):
        with Engine(disable_radix_cache=not cache_on, **opts) as engine:
            vocab = engine.server_info().core.vocab_size
            if cache_on:
                cold, warm = ttft_pair(engine, args.prefix_len, vocab, args.seed, args.runs)
            results[cache_on] = shared_prompt_throughput(engine, args.system_len, args.num_prompts,
                                                         args.output_len, vocab, args.seed)
    print(f"TTFT, {args.prefix_len}-token prefix (median of {args.runs}): cold {cold * 1e3:.0f} ms, "
          f"cached {warm * 1e3:.0f} ms  ({cold / warm:.1f}x lower)")
    print(f"{args.num_prompts} requests sharing a {args.system_len}-token prompt, {args.output_len} new "
          f"tokens: cache on {results[True]:.1f} tok/s, off {results[False]:.1f} tok/s  "
          f"({results[True] / results[False]:.2f}x)")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("prefix", help="prefix cache: cached vs cold TTFT, shared-prompt throughput")
    add_engine_arguments(p)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
