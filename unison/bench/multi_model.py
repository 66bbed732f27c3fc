"""`unison bench models`: one server of several models. Per model: the time to first token cold (its
core loads first, on that request) and warm; then one model's serving throughput behind that
server (every model loaded) beside a server of that model alone (and its warm TTFT there), both
running, trials alternated.

    unison bench models [--model NAME=PATH ...] [--throughput-model NAME] [--trials 3]

Each model's first request is its cold TTFT (load included); the median of the next five, its
warm TTFT. Throughput: the random dataset (vLLM's), `--num-prompts` at `--max-concurrency`, one
warm-up run on each server first; the ratio is the medians' (several models / one model).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from unison.bench.datasets import random_requests
from unison.bench.local_server import serving
from unison.bench.serve import run_benchmark

UNISON = [sys.executable, "-m", "unison.cli", "serve"]
WARM_RUNS = 5


def ttft(url: str, model: str) -> float:
    """Seconds to the first streamed token of a short completion."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: {r.status_code} {r.read().decode()}")
        for line in r.iter_lines():
            if line.startswith('data: {"id"'):
                return time.perf_counter() - t0
    raise RuntimeError(f"{model}: the stream ended without a token")


def throughput(url: str, model: str, args: argparse.Namespace) -> float:
    """Output tokens/s of one benchmark run."""
    samples = random_requests(args.num_prompts, args.input_len, args.output_len, seed=0)
    out = asyncio.run(run_benchmark(samples, url, model=model, max_concurrency=args.max_concurrency,
                                    ignore_eos=True, quiet=True))
    if out["summary"]["failed"]:
        raise RuntimeError(f"{model} at {url}: {out['summary']['first_error']}")
    return float(out["summary"]["output_throughput"])


def main(args: argparse.Namespace) -> int:
    if not args.model:
        from unison.model.weights.loader import default_gguf_path

        args.model = [f"smollm2-135m={default_gguf_path()}"]
    names = [m.partition("=")[0] for m in args.model]
    target = args.throughput_model or names[0]
    if target not in names:
        raise ValueError(f"--throughput-model {target!r} is not among {names}")
    common = ["--tokenizer-worker-num", str(args.tokenizer_worker_num)]
    if args.num_threads:
        common += ["--num-threads", str(args.num_threads)]
    several = [*UNISON, *(a for m in args.model for a in ("--model", m)), "--models-max", str(len(names)),
               *common]
    path = dict(m.split("=", 1) for m in args.model)[target]
    alone = [*UNISON, path, "--served-model-name", target, *common]
    with serving(several, "unison-bench-models", "/health", timeout=900) as url:
        print(f"{'model':<24} {'cold TTFT (load included)':>26} {'warm TTFT (median of 5)':>24}")
        for name in names:
            cold = ttft(url, name)
            warm = statistics.median(ttft(url, name) for _ in range(WARM_RUNS))
            print(f"{name:<24} {cold * 1000:>23.0f} ms {warm * 1000:>21.1f} ms", flush=True)
        with serving(alone, "unison-bench-models-alone", timeout=900) as url_alone:
            warm = statistics.median(ttft(url_alone, target) for _ in range(WARM_RUNS))
            print(f"{target + ' alone':<24} {'':>26} {warm * 1000:>21.1f} ms", flush=True)
            ours, single = [], []
            throughput(url, target, args), throughput(url_alone, target, args)  # warm-up
            for trial in range(args.trials):
                ours.append(throughput(url, target, args))
                single.append(throughput(url_alone, target, args))
                print(f"trial {trial + 1}: {target} behind {len(names)} models {ours[-1]:.1f} tok/s, "
                      f"alone {single[-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(ours) / statistics.median(single)
    print(f"{target}: output tok/s, median of {args.trials}: {statistics.median(ours):.1f} behind "
          f"{len(names)} models, {statistics.median(single):.1f} alone: ratio {ratio:.3f}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="several models behind one server: cold and warm TTFT per model, "
                                      "throughput beside a one-model server")
    p.add_argument("--model", action="append", default=None, metavar="NAME=PATH",
                   help="a model to serve (repeatable; default: the embedded SmolLM2-135M)")
    p.add_argument("--throughput-model", default=None, help="the model whose throughput is compared "
                                                            "(default: the first)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--tokenizer-worker-num", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=main)
