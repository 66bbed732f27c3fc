"""Serving side by side: `unison serve` and llama.cpp's `llama-server` on the same GGUF, one after
the other in one invocation, loaded by the same client (`unison bench serve`), plus Unison's
offline figure at the same concurrency.

    python benchmarks/serve_comparison.py --llama-server PATH/llama-server [--trials 3]

llama-server is not a dependency of Unison: build it once (see BENCHMARKS.md). Each server runs
alone on the machine while it is measured; prompts are ~40 random words (≈ tokens), 128 new
tokens with ignore_eos, greedy (`--input-len 512 --output-len 1` times a prefill: see TTFT).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from unison.model.loader import default_gguf_path

UNISON = [sys.executable, "-m", "unison.cli"]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


LENGTHS = {"input": 40, "output": 128}  # set from the command line
SEEDS = iter(range(1, 1 << 30))  # a fresh seed per run: no run's prompts are in a server's prompt cache


def bench_serve(url: str, concurrency: int, prompts: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([*UNISON, "bench", "serve", "--base-url", url, "--num-prompts", str(prompts),
                        "--seed", str(next(SEEDS)),
                        "--max-concurrency", str(concurrency), "--input-len", str(LENGTHS["input"]),
                        "--output-len", str(LENGTHS["output"]),
                        "--ignore-eos", "--quiet", "--result-file", f.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))["summary"]


def measure_server(name: str, cmd: list[str], port: int, levels: list[int]) -> dict[int, dict]:
    url = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.gettempdir()) / f"serve-comparison-{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, proc)
        bench_serve(url, 4, 4)  # warm up
        return {c: bench_serve(url, c, max(4, c if c >= 64 else 2 * c)) for c in levels}
    finally:
        stop(proc)
        log.close()


def offline(concurrency: int, gguf: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([*UNISON, "bench", "offline", "--model-path", gguf, "--num-prompts", str(concurrency),
                        "--input-len", str(LENGTHS["input"]), "--output-len", str(LENGTHS["output"]),
                        "--no-ceiling", "--quiet", "--result-file", f.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))["unison"]["output_tok_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="path to llama.cpp's llama-server")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-path", default=None, help="a GGUF file (default: the embedded model)")
    p.add_argument("--unison-args", default="", help="more `unison serve` flags, e.g. '--quantization none'")
    p.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '-nr' where its weight "
                                                    "repacking crashes")
    p.add_argument("--input-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-offline", action="store_true", help="skip Unison's offline figure")
    p.add_argument("--slots", default="16,64", help="llama-server -np settings to run (16 and/or 64)")
    args = p.parse_args()
    LENGTHS.update(input=args.input_len, output=args.output_len)
    levels = [int(c) for c in args.concurrency.split(",")]
    gguf = args.model_path or str(default_gguf_path())
    llama = [args.llama_server, "-m", gguf, "-t", str(args.threads), "--host", "127.0.0.1",
             *args.llama_args.split()]
    per_slot = args.input_len + args.output_len + 64  # each slot's share of llama-server's context
    unison = [*UNISON, "serve", "--port", "30100", "--model-path", gguf, *args.unison_args.split()]
    setups = {
        "unison": (unison, 30100, levels),
        "llama-server -np 16": ([*llama, "-np", "16", "-c", str(max(8192, 16 * per_slot)), "--port", "30101"],
                                30101, levels),
        # 64 slots share the context: 16384 gives each the 256 tokens a request needs here.
        "llama-server -np 64": ([*llama, "-np", "64", "-c", "16384", "--port", "30102"], 30102,
                                [c for c in levels if c >= 64]),
    }
    slots = {int(s) for s in args.slots.split(",")}
    setups = {name: s for name, s in setups.items()
              if not name.startswith("llama") or int(name.split()[-1]) in slots}
    rows: dict[tuple[str, int], list[dict]] = {}
    for trial in range(args.trials):
        for name, (cmd, port, lv) in setups.items():
            for c, summary in measure_server(name.split()[0] + name.split()[-1], cmd, port, lv).items():
                rows.setdefault((name, c), []).append(summary)
        for c in [] if args.no_offline else levels:
            rows.setdefault(("unison offline", c), []).append({"output_throughput": offline(c, gguf)})
        print(f"trial {trial + 1} done", file=sys.stderr)
    print(f"{'server':<22}{'clients':>8}{'out tok/s (runs)':>34}{'median':>9}{'TTFT ms':>9}{'TPOT ms':>9}")
    for (name, c), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        tps = [r["output_throughput"] for r in runs]
        ttft = statistics.median(r.get("median_ttft_ms") or 0 for r in runs)
        tpot = statistics.median(r.get("median_tpot_ms") or 0 for r in runs)
        print(f"{name:<22}{c:>8}{', '.join(f'{t:.1f}' for t in tps):>34}{statistics.median(tps):>9.1f}"
              f"{ttft:>9.0f}{tpot:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
