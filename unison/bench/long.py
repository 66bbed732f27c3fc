"""`unison bench long`: long prompts. TTFT of one long prompt cold, from the prefix cache in RAM,
and from its disk tier after a restart; decode speed at that context with float16 and int8 KV,
one request alone and `--decode-batch` together (the prompt, cached, then each its own suffix:
attention then reads a long context per row, as a batch of long prompts does). Beside
llama-server (optional) on the same GGUF, one request: cold, from its prompt cache
(`--cache-ram`), restored from a slot file after a restart (`--slot-save-path`), with f16 and
q8_0 KV.

    unison bench long [--model-path GGUF] [--prompt-len 8000] [--llama-server PATH]
    unison bench long --quality [--prompts 16] [--prompt-len 1000] [--prompt-set quiz|chat]

Both engines are servers, measured by one client over llama-server's own `/completion` route
(Unison serves it too), greedy with ignore_eos: TTFT is the time to the first streamed token,
decode speed the tokens after it over the time after it. Each server runs alone.

`--quality` measures instead how close each 8-bit cache stays to float16's, offline: quiz
transcripts (datasets.quiz_prompts, the tests' kind) or, with `--prompt-set chat`, input-grounded
tasks in one user message of the model's chat template (datasets.grounded_chats); greedy, 16 new
tokens; per cache type, the prompts whose tokens are float16's, and the first step's top-5
logprob distance (over the tokens both top 5s hold: median and max).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import httpx

from unison.bench import Json
from unison.bench.local_server import serving

if TYPE_CHECKING:
    from unison.frontend.text.tokenizer import Tokenizer

UNISON = [sys.executable, "-m", "unison.cli"]


@dataclass
class Timing:
    ttft_s: float
    decode_tok_s: float | None  # None: one token asked for
    cached_tokens: int | None  # as the server reports it (Unison's /completion: tokens_cached)


def server(cmd: list[str], name: str, ready_path: str) -> AbstractContextManager[str]:
    """`cmd` serving alone (a long prefill may take minutes; SIGTERM: Unison finishes its disk
    writes before it exits)."""
    return serving(cmd, f"unison-bench-long-{name}", ready_path, timeout=600, stop_timeout=120)


def complete(url: str, prompt: list[int], n: int) -> Timing:
    """One streamed /completion of `n` tokens."""
    body = {"prompt": prompt, "n_predict": n, "stream": True, "ignore_eos": True, "temperature": 0,
            "cache_prompt": True, "return_tokens": True}
    t0 = time.perf_counter()
    first = last = None
    tokens, cached = 0, None
    with httpx.stream("POST", url + "/completion", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if new := len(chunk.get("tokens") or []) or int(bool(chunk.get("content"))):
                tokens += new
                last = time.perf_counter()
                first = first or last
            if chunk.get("stop"):
                cached = chunk.get("tokens_cached", chunk.get("timings", {}).get("cache_n"))
    if first is None or last is None:
        raise RuntimeError(f"{url}: no token came back")
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return Timing(first - t0, rate, cached)


def batch(url: str, prompt: list[int], n: int, size: int) -> Timing:
    """`size` requests at once, each `prompt` and a suffix of its own, `n` tokens each; the
    decode speed is theirs together."""
    suffixes = [[1000 + 16 * i + j for j in range(16)] for i in range(size)]
    with ThreadPoolExecutor(size) as pool:
        timings = list(pool.map(lambda s: complete(url, prompt + s, n), suffixes))
    return Timing(max(t.ttft_s for t in timings), sum(t.decode_tok_s or 0 for t in timings), None)


def unison(args: argparse.Namespace, gguf: str, prompt: list[int]) -> dict[str, Timing]:
    base = [*UNISON, "serve", "--model-path", gguf, "--num-threads", str(args.threads),
            "--context-length", str(args.prompt_len + args.output_len + 16)]
    out: dict[str, Timing] = {}
    folder = Path(tempfile.mkdtemp(prefix="unison-bench-kv-"))
    try:
        # Both dtypes with the disk tier: a cold request's blocks are written while it decodes.
        disk = [*base, "--kv-cache-dir", str(folder), "--kv-cache-dtype", "float16"]
        with server(disk, "unison", "/v1/models") as url:
            out["cold, float16 KV"] = complete(url, prompt, args.output_len)
            out["from RAM"] = complete(url, prompt, 1)
            out[f"{args.decode_batch} at once, float16 KV"] = batch(url, prompt, args.output_len,
                                                                    args.decode_batch)
        with server(disk, "unison-restart", "/v1/models") as url:
            out["from disk, after a restart"] = complete(url, prompt, 1)
        with server([*disk[:-1], "int8"], "unison-int8", "/v1/models") as url:
            out["cold, int8 KV"] = complete(url, prompt, args.output_len)
            out[f"{args.decode_batch} at once, int8 KV"] = batch(url, prompt, args.output_len,
                                                                 args.decode_batch)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def llama_server(args: argparse.Namespace, gguf: str, prompt: list[int]) -> dict[str, Timing]:
    folder = Path(tempfile.mkdtemp(prefix="unison-bench-slots-"))
    base = [args.llama_server, "-m", gguf, "-t", str(args.threads), "--host", "127.0.0.1", "-np", "1",
            "-c", str(args.prompt_len + args.output_len + 16), "--cache-ram", "8192",
            "--slot-save-path", str(folder)]
    out: dict[str, Timing] = {}
    try:
        with server([*base, "-ctk", "f16", "-ctv", "f16"], "llama-server", "/health") as url:
            out["cold, float16 KV"] = complete(url, prompt, args.output_len)
            out["from RAM"] = complete(url, prompt, 1)
            saved = httpx.post(url + "/slots/0?action=save", json={"filename": "long.bin"}, timeout=600)
            saved.raise_for_status()
        with server([*base, "-ctk", "f16", "-ctv", "f16"], "llama-server-restart", "/health") as url:
            t0 = time.perf_counter()
            httpx.post(url + "/slots/0?action=restore", json={"filename": "long.bin"},
                       timeout=600).raise_for_status()
            restore = time.perf_counter() - t0
            t = complete(url, prompt, 1)
            out["from disk, after a restart"] = Timing(restore + t.ttft_s, None, t.cached_tokens)
        q8 = [*base, "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]  # a quantized V needs flash attention
        with server(q8, "llama-server-q8", "/health") as url:
            out["cold, int8 KV"] = complete(url, prompt, args.output_len)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def report(results: dict[str, dict[str, Timing]], batch_size: int) -> str:
    names = list(results)
    lines = [f"{'':<30}" + "".join(f"{n:>36}" for n in names)]
    for row in results[names[0]]:
        cells = []
        for n in names:
            t = results[n].get(row)
            cells.append("" if t is None else f"TTFT {t.ttft_s * 1e3:,.0f} ms" +
                         (f", {t.decode_tok_s:.1f} tok/s" if t.decode_tok_s else "") +
                         (f", {t.cached_tokens} cached" if t.cached_tokens else ""))
        lines.append(f"{row:<30}" + "".join(f"{c:>36}" for c in cells))
    ours = results["unison"]
    cold, disk, ram = (ours[k].ttft_s for k in ("cold, float16 KV", "from disk, after a restart", "from RAM"))
    lines.append(f"unison: from disk after a restart {cold / disk:.1f}x faster than cold, "
                 f"from RAM {cold / ram:.1f}x")
    for how in ("cold", f"{batch_size} at once"):
        f16, i8 = ours[f"{how}, float16 KV"].decode_tok_s, ours[f"{how}, int8 KV"].decode_tok_s
        if f16 and i8:
            lines.append(f"unison: int8 KV decode {i8 / f16:.2f}x float16's ({how})")
    return "\n".join(lines)


def quality(args: argparse.Namespace) -> int:
    from unison import Engine
    params = {"temperature": 0, "max_new_tokens": 16}
    outs: dict[str, list[Json]] = {}
    for dtype in ("float16", "int8", "fp8_e4m3", "fp8_e5m2"):
        with Engine(model_path=args.model_path, kv_cache_dtype=dtype, num_threads=args.threads) as engine:
            prompts = quality_prompts(engine.tokenizer, args)
            outs[dtype] = cast(list[Json], engine.generate(input_ids=prompts, sampling_params=params,
                                                           return_logprob=True, top_logprobs_num=5))
    print(f"{args.prompts} {args.prompt_set} prompts of {args.prompt_len}+ tokens, 16 greedy tokens, "
          "against float16 KV")
    for dtype, got in list(outs.items())[1:]:
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(outs["float16"], got))
        gaps = [abs(lp - top5(b)[t]) for a, b in zip(outs["float16"], got) for t, lp in top5(a).items()
                if t in top5(b)]
        print(f"{dtype:<10} greedy equal {same}/{len(got)}; first-step top-5 logprobs: median "
              f"{statistics.median(gaps):.4f}, max {max(gaps):.4f}")
    return 0


def quality_prompts(tokenizer: Tokenizer, args: argparse.Namespace) -> list[list[int]]:
    from unison.bench.datasets import grounded_chats, quiz_prompts

    if args.prompt_set == "quiz":
        return quiz_prompts(tokenizer.encode, args.prompts, args.prompt_len)

    def render(text: str) -> list[int]:  # with the generation prompt; the template writes any BOS
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return tokenizer.encode(prompt, add_special_tokens=False)
    return grounded_chats(tokenizer.encode, render, args.prompts, args.prompt_len)


def top5(out: Json) -> dict[int, float]:
    return {tid: lp for lp, tid, _ in out["meta_info"]["output_top_logprobs"][0]}


def main(args: argparse.Namespace) -> int:
    from unison.model.weights.loader import default_gguf_path

    if args.quality:
        args.prompt_len = args.prompt_len or 1000
        return quality(args)
    args.prompt_len = args.prompt_len or 8000
    gguf = args.model_path or str(default_gguf_path())
    rng = random.Random(args.seed)  # token ids that every vocabulary of these models has
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
    results = {"unison": unison(args, gguf, prompt)}
    if args.llama_server:
        results["llama-server"] = llama_server(args, gguf, prompt)
    print(f"{args.prompt_len}-token prompt, {args.output_len} new tokens, {args.threads} threads, {gguf}")
    print(report(results, args.decode_batch))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("long", help="long prompts: TTFT cold / from RAM / from disk after a restart, "
                                    "decode with float16 and int8 KV (beside llama-server)")
    p.add_argument("--model-path", help="a GGUF (default: the embedded model)")
    p.add_argument("--prompt-len", type=int, help="tokens (default 8000; with --quality 1000)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--decode-batch", type=int, default=4, help="requests decoding at once, each at the "
                                                                "prompt's context (Unison)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", help="path to llama.cpp's llama-server, to run beside")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", action="store_true", help="each 8-bit cache's distance to float16's instead")
    p.add_argument("--prompts", type=int, default=16, help="--quality's prompts")
    p.add_argument("--prompt-set", choices=("quiz", "chat"), default="quiz",
                   help="--quality's prompts: quiz transcripts, or grounded tasks in the chat template")
    p.set_defaults(func=main)
