"""`unison bench compare`: `unison serve` and llama.cpp's `llama-server` on the same GGUF, one after
the other in one invocation, loaded by the same client (`unison bench serve`'s), plus Unison's
offline figure at the same concurrency.

    unison bench compare --llama-server PATH/llama-server [--trials 3]

llama-server is not a dependency of Unison: build it once (see BENCHMARKS.md). Each server runs
alone on the machine while it is measured; prompts are ~40 random words (≈ tokens), 128 new
tokens with ignore_eos, greedy (`--input-len 512 --output-len 1` times a prefill: see TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from unison.bench.datasets import random_requests
from unison.bench.local_server import serving
from unison.bench.serve import Summary, run_benchmark

UNISON = [sys.executable, "-m", "unison.cli"]


@dataclass
class Setup:
    """One server to measure: its command line (the port appended) and the concurrencies to run."""
    name: str
    cmd: list[str]
    levels: list[int]


class Client:
    """`unison bench serve`'s client at one prompt shape, a fresh seed per run: no run's prompts are
    in a server's prompt cache."""

    def __init__(self, input_len: int, output_len: int) -> None:
        self.input_len, self.output_len, self.seed = input_len, output_len, 0

    def run(self, url: str, concurrency: int, prompts: int) -> Summary:
        self.seed += 1
        samples = random_requests(prompts, self.input_len, self.output_len, seed=self.seed)
        out = asyncio.run(run_benchmark(samples, url, max_concurrency=concurrency, seed=self.seed,
                                        ignore_eos=True, quiet=True))
        return out["summary"]


def measure_server(setup: Setup, client: Client) -> dict[int, Summary]:
    with serving(setup.cmd, f"unison-bench-compare-{setup.name.replace(' ', '')}") as url:
        client.run(url, 4, 4)  # warm up
        return {c: client.run(url, c, max(4, c if c >= 64 else 2 * c)) for c in setup.levels}


def offline(concurrency: int, gguf: str, input_len: int, output_len: int) -> float:
    """`unison bench offline`'s output tok/s, in its own process (this one stays free of torch)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([*UNISON, "bench", "offline", "--model-path", gguf, "--num-prompts", str(concurrency),
                        "--input-len", str(input_len), "--output-len", str(output_len),
                        "--no-ceiling", "--quiet", "--result-file", f.name],
                       check=True, stdout=subprocess.DEVNULL)
        rate: float = json.loads(Path(f.name).read_text())["unison"]["output_tok_s"]
        return rate


def bound(threads: int, gguf: str | None = None) -> tuple[float, int]:
    """(the memory's read GB/s on `threads` threads, the bytes a decode step of `gguf` reads, 0
    without one), by `unison bench bandwidth` in its own process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        model = ["--model-path", gguf] if gguf else []
        subprocess.run([*UNISON, "bench", "bandwidth", *model, "--num-threads", str(threads),
                        "--result-file", f.name], check=True, stdout=subprocess.DEVNULL)
        out = json.loads(Path(f.name).read_text())
        return out["read_gbps"], out["step_bytes"]


def setups(args: argparse.Namespace, gguf: str, levels: list[int]) -> list[Setup]:
    llama = [args.llama_server, "-m", gguf, "-t", str(args.threads), "--host", "127.0.0.1",
             *shlex.split(args.llama_args)]
    per_slot = args.input_len + args.output_len + 64  # each slot's share of llama-server's context
    slots = {int(s) for s in args.slots.split(",")}
    out = [Setup("unison", [*UNISON, "serve", "--model-path", gguf, *shlex.split(args.unison_args)], levels)]
    if 16 in slots:
        out.append(Setup("llama-server -np 16", [*llama, "-np", "16", "-c", str(max(8192, 16 * per_slot))],
                         levels))
    if 64 in slots:  # 64 slots share the context: 16384 gives each the 256 tokens a request needs here
        out.append(Setup("llama-server -np 64", [*llama, "-np", "64", "-c", "16384"],
                         [c for c in levels if c >= 64]))
    return out


def main(args: argparse.Namespace) -> int:
    from unison.model.weights.loader import default_gguf_path

    levels = [int(c) for c in args.concurrency.split(",")]
    gguf = args.model_path or str(default_gguf_path())
    client = Client(args.input_len, args.output_len)
    rows: dict[tuple[str, int], list[float]] = {}  # output tok/s per run
    latencies: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (TTFT, TPOT) ms per run
    bandwidths: list[float] = []  # measured beside each trial: the machine's share of memory varies
    for trial in range(args.trials):
        if 1 in levels:
            bandwidths.append(bound(args.threads)[0])
        for setup in setups(args, gguf, levels):
            for c, summary in measure_server(setup, client).items():
                rows.setdefault((setup.name, c), []).append(summary["output_throughput"])
                latencies.setdefault((setup.name, c), []).append(
                    (summary["median_ttft_ms"] or 0, summary["median_tpot_ms"] or 0))
        for c in [] if args.no_offline else levels:
            rate = offline(c, gguf, args.input_len, args.output_len)
            rows.setdefault(("unison offline", c), []).append(rate)
            latencies.setdefault(("unison offline", c), []).append((0, 0))
        print(f"trial {trial + 1} done", file=sys.stderr)
    print(f"{'server':<22}{'clients':>8}{'out tok/s (runs)':>34}{'median':>9}{'TTFT ms':>9}{'TPOT ms':>9}")
    for (name, c), tps in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ttft = statistics.median(t for t, _ in latencies[name, c])
        tpot = statistics.median(t for _, t in latencies[name, c])
        print(f"{name:<22}{c:>8}{', '.join(f'{t:.1f}' for t in tps):>34}{statistics.median(tps):>9.1f}"
              f"{ttft:>9.0f}{tpot:>9.1f}")
    if 1 in levels:  # one stream against the memory's bound: the step's bytes over its time
        step = bound(args.threads, gguf)[1]
        gbps = statistics.median(bandwidths)
        print(f"one stream's bound: a step reads {step / 2**20:.0f} MiB at {gbps:.1f} GB/s (the median of "
              f"{', '.join(f'{b:.1f}' for b in bandwidths)}): {step / gbps / 1e6:.1f} ms a token")
        for (name, c), lat in sorted(latencies.items()):
            tpot = statistics.median(t for _, t in lat)
            if c == 1 and tpot:
                achieved = step / tpot / 1e6
                print(f"  {name:<22} {achieved:5.1f} GB/s: {achieved / gbps:.2f} of the bound")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("compare", help="unison serve beside llama.cpp's llama-server on one GGUF, one client")
    p.add_argument("--llama-server", required=True, help="path to llama.cpp's llama-server")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--model-path", default=None, help="a GGUF file (default: the embedded model)")
    p.add_argument("--unison-args", default="", help="more `unison serve` flags, e.g. '--quantization none'")
    p.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '-nr' where its weight "
                                                    "repacking crashes")
    p.add_argument("--input-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-offline", action="store_true", help="skip Unison's offline figure")
    p.add_argument("--slots", default="16,64", help="llama-server -np settings to run (16 and/or 64)")
    p.set_defaults(func=main)
