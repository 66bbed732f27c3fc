"""`unison bench serve`: load-test any OpenAI-compatible server (Unison, llama-server, vLLM).

Streams every request (SSE) and measures as vLLM's `bench serve` does:
TTFT = request sent → first content chunk; ITL = gaps between consecutive content chunks;
E2E latency = request sent → last chunk with choices; TPOT = (latency − TTFT) / (output tokens − 1)
per request with more than one token. Output tokens come from the server's `usage` (asked for
with `stream_options.include_usage`), else one per content chunk. Throughputs divide by the
wall time from the first arrival to the last completion. Arrivals are Poisson at
`--request-rate` (seeded exponential gaps; inf sends all at once), under a `--max-concurrency`
cap; a request waiting for a slot is not yet sent, so its TTFT does not include the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from unison.bench import Json
from unison.bench.datasets import (
    SampleRequest,
    grounded_requests,
    load_tokenizer_counter,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)

if TYPE_CHECKING:  # httpx loads when a benchmark runs, not when the CLI builds its parsers
    import httpx

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
METRICS = (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
           ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))
STATS = ("mean", "median", "std", "p90", "p99")


@dataclass
class RequestResult:
    prompt_tokens: int  # the server's count when it reports usage, else the dataset's
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # when it was sent, seconds after the benchmark began
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage, when reported)


# vLLM's serving metrics by its names: counts, seconds, rates, ms per statistic, the first error.
Summary = Json


class BenchmarkRun(TypedDict):
    model: str
    url: str
    duration: float  # seconds, the first arrival to the last completion
    results: list[RequestResult]
    summary: Summary


# ---- arrivals -------------------------------------------------------------------------------

def inter_arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Gaps between consecutive requests: exponential with mean 1/rate (Poisson arrivals)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """When each request is due, in seconds after the start; the first one at once."""
    if n == 0:
        return []
    offsets = [0.0]
    for gap in inter_arrival_times(n - 1, rate, seed):
        offsets.append(offsets[-1] + gap)
    return offsets


# ---- metrics --------------------------------------------------------------------------------

def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(STATS)
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> Summary:
    """vLLM's serving metrics. Failed requests are counted, not timed; latencies in ms."""
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    summary: Summary = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / max(in_tokens, 1),
    }
    for name, values in series.items():
        for stat, value in _stats(values).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary


def format_summary(s: Summary) -> str:
    def row(label: str, value: float | str | None) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40}{'-' if value is None else value:>10}"

    lines = [f"{' Serving Benchmark Result ':=^50}",
             row("Successful requests:", s["completed"]),
             row("Failed requests:", s["failed"]),
             row("Benchmark duration (s):", s["duration_s"]),
             row("Total input tokens:", s["total_input_tokens"]),
             row("Total generated tokens:", s["total_output_tokens"]),
             row("Request throughput (req/s):", s["request_throughput"]),
             row("Output token throughput (tok/s):", s["output_throughput"]),
             row("Total token throughput (tok/s):", s["total_token_throughput"]),
             row("Prefix cache hit rate:", s["prefix_cache_hit_rate"])]
    if "spec_acceptance_rate" in s:
        lines.append(row("Draft acceptance rate:", s["spec_acceptance_rate"]))
    for name, title in METRICS:
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p90", "p99"):
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            lines.append(row(f"{label} {name.upper()} (ms):", s[f"{stat}_{name}_ms"]))
    lines.append("=" * 50)
    if s["first_error"]:
        lines.append(f"first error: {s['first_error']}")
    return "\n".join(lines)


# ---- the client -----------------------------------------------------------------------------

def endpoint_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[:-3]
    return base + endpoint


def build_payload(endpoint: str, model: str, sample: SampleRequest,
                  ignore_eos: bool) -> Json:
    body: Json = {"model": model, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        # The current name and the older one: servers read one or the other.
        body["max_completion_tokens"] = body["max_tokens"] = sample.output_len
    else:
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _has_content(choice: Json) -> bool:
    if "delta" in choice:
        delta = choice["delta"] or {}
        return any(delta.get(k) for k in ("content", "reasoning_content", "reasoning"))
    return bool(choice.get("text"))


def _short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


async def send_request(client: httpx.AsyncClient, url: str, payload: Json, prompt_tokens: int,
                       headers: dict[str, str], t_start: float = 0.0) -> RequestResult:
    result = RequestResult(prompt_tokens=prompt_tokens)
    chunks, usage = 0, None
    sent = time.perf_counter()
    result.start = sent - t_start if t_start else 0.0
    last_content = last_choice = sent
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {_short(body)}"
                return result
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    err = msg["error"]
                    if isinstance(err, dict):
                        err = err.get("message", err)
                    result.error = _short(str(err))
                    return result
                choices = msg.get("choices") or []
                if choices:
                    last_choice = now
                    if _has_content(choices[0]):
                        if chunks == 0:
                            result.ttft = now - sent
                        else:
                            result.itl.append(now - last_content)
                        last_content = now
                        chunks += 1
                if msg.get("usage"):
                    usage = msg["usage"]
    except Exception as e:  # a failed request is a result, not the end of the run
        result.error = _short(f"{type(e).__name__}: {e}")
        return result
    if chunks == 0:
        result.error = "no content in the response"
        return result
    result.latency = last_choice - sent
    result.output_tokens = chunks
    if usage:
        result.output_tokens = usage.get("completion_tokens") or chunks
        result.prompt_tokens = usage.get("prompt_tokens") or prompt_tokens
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return result


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    url = endpoint_url(base_url, "/v1/models")
    try:
        resp = await client.get(url, headers=_headers(api_key))
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as e:
        raise ValueError(f"could not read the model name from {url} ({type(e).__name__}: {e}); "
                         "pass --model") from None


SPEC_COUNTERS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")


async def spec_counters(client: httpx.AsyncClient, base_url: str,
                        api_key: str | None) -> tuple[float, float] | None:
    """Drafted and accepted tokens so far, from the server's /metrics (Unison's or vLLM's names);
    None where the server exports neither."""
    try:
        resp = await client.get(endpoint_url(base_url, "/metrics"), headers=_headers(api_key))
        text = resp.text if resp.status_code == 200 else ""
    except Exception:
        return None
    found = {name: 0.0 for name in SPEC_COUNTERS}
    for line in text.splitlines():
        metric, _, value = line.partition(" ")
        name = metric.split("{")[0].split(":")[-1]
        if name in found:
            found[name] += float(value)
    if not any(name in text for name in SPEC_COUNTERS):
        return None
    drafted, accepted = (found[name] for name in SPEC_COUNTERS)
    return drafted, accepted


async def run_benchmark(samples: list[SampleRequest], base_url: str, endpoint: str = COMPLETIONS,
                        model: str | None = None, request_rate: float = math.inf,
                        max_concurrency: int | None = None, seed: int = 0,
                        api_key: str | None = None, ignore_eos: bool = False, quiet: bool = False,
                        test_request: bool = True) -> BenchmarkRun:
    import httpx

    url = endpoint_url(base_url, endpoint)
    headers = _headers(api_key)
    limits = httpx.Limits(max_connections=max_concurrency,
                          max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(6 * 3600.0, connect=60.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = model or await first_model(client, base_url, api_key)
        if test_request:  # fail fast on a wrong URL, model or key, before timing anything
            s = samples[0]
            r = await send_request(client, url, build_payload(endpoint, model, s, ignore_eos),
                                   s.prompt_len, headers)
            if r.error:
                raise ValueError(f"test request to {url} failed: {r.error}")
        if not quiet:
            cap = max_concurrency or "none"
            print(f"{len(samples)} requests to {url} (model {model}), request rate {request_rate}, "
                  f"max concurrency {cap}")
        bar = None
        if not quiet:
            from tqdm import tqdm

            bar = tqdm(total=len(samples), unit="req")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        offsets = arrival_offsets(len(samples), request_rate, seed)

        async def one(sample: SampleRequest, due: float) -> RequestResult:
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = build_payload(endpoint, model, sample, ignore_eos)
            async with sem:
                r = await send_request(client, url, payload, sample.prompt_len, headers, t0)
            if bar is not None:
                bar.update(1)
            return r

        spec_before = await spec_counters(client, base_url, api_key)
        t0 = time.perf_counter()
        try:
            tasks = (one(s, due) for s, due in zip(samples, offsets, strict=True))
            results = await asyncio.gather(*tasks)
        finally:
            if bar is not None:
                bar.close()
        duration = time.perf_counter() - t0
        spec_after = await spec_counters(client, base_url, api_key)
    summary = summarize(list(results), duration)
    if spec_before is not None and spec_after is not None:
        drafted, accepted = (b - a for a, b in zip(spec_before, spec_after))
        summary["spec_acceptance_rate"] = accepted / drafted if drafted else None
    return {"model": model, "url": url, "duration": duration, "results": list(results), "summary": summary}


# ---- command line ---------------------------------------------------------------------------

def load_samples(args: argparse.Namespace) -> list[SampleRequest]:
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        count = load_tokenizer_counter(args.tokenizer) if args.tokenizer else None
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, args.output_len,
                                 count)
    if args.dataset == "grounded":
        return grounded_requests(args.num_prompts, args.output_len or 128, args.seed)
    if args.dataset == "generated-shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.gsp_num_groups, args.gsp_system_prompt_len,
                                      args.gsp_question_len, args.output_len or 128, args.seed)
    return random_requests(args.num_prompts, args.input_len, args.output_len or 128,
                           args.range_ratio, args.seed)


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    samples = load_samples(args)
    if args.routings:
        return _compare_routings(args, samples)
    if not args.base_url:
        raise ValueError("--base-url is required (or --routings, which starts the servers)")
    out = asyncio.run(run_benchmark(
        samples, args.base_url, args.endpoint, args.model, args.request_rate, args.max_concurrency,
        args.seed, args.api_key, args.ignore_eos, args.quiet))
    summary = out["summary"]
    print(format_summary(summary))
    if args.result_file:
        config = {"base_url": args.base_url, "url": out["url"], "endpoint": args.endpoint,
                  "model": out["model"], "dataset": args.dataset, "dataset_path": args.dataset_path,
                  "num_prompts": args.num_prompts, "input_len": args.input_len,
                  "output_len": args.output_len, "range_ratio": args.range_ratio,
                  "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                  "max_concurrency": args.max_concurrency, "seed": args.seed,
                  "ignore_eos": args.ignore_eos}
        doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config, "summary": summary,
               "requests": [asdict(r) for r in out["results"]]}
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        if not args.quiet:
            print(f"results written to {args.result_file}")
    return 0 if summary["completed"] else 1


def _compare_routings(args: argparse.Namespace, samples: list[SampleRequest]) -> int:
    from unison.bench.routing import compare, format_table

    def run(url: str) -> Summary:
        out = asyncio.run(run_benchmark(samples, url, args.endpoint, args.model, args.request_rate,
                                        args.max_concurrency, args.seed, args.api_key, args.ignore_eos,
                                        quiet=True, test_request=False))
        return out["summary"]

    rows = compare(samples, args.routings.split(","), args.data_parallel_size, args.trials,
                   args.serve_args, run)
    print(format_table(rows))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "routings": rows,
                       "argv": {k: v for k, v in vars(args).items() if k != "func"}}, f, indent=1)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL)")
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--endpoint", choices=[COMPLETIONS, CHAT], default=COMPLETIONS)
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--dataset", choices=["random", "sharegpt", "generated-shared-prefix", "grounded"],
                   default="random", help="grounded: repeat / fix / extract / reformat tasks on a text")
    p.add_argument("--gsp-num-groups", type=int, default=8, help="shared-prefix: distinct system prompts")
    p.add_argument("--gsp-system-prompt-len", type=int, default=512, help="shared-prefix: its words")
    p.add_argument("--gsp-question-len", type=int, default=32, help="shared-prefix: words per question")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or its directory) to count ShareGPT tokens; "
                        "default: estimate from words")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt words (≈ tokens)")
    p.add_argument("--output-len", type=int, default=None,
                   help="max tokens per request (random: default 128; "
                        "ShareGPT: each reply's length)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="default: $OPENAI_API_KEY")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--result-file", default=None, help="write per-request data and the summary")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--routings", default=None,
                   help="compare data-parallel routing modes, e.g. least_loaded,prefix,kv: a server "
                        "is started for each (--base-url is not used)")
    p.add_argument("--data-parallel-size", type=int, default=2, help="--routings: replicas")
    p.add_argument("--trials", type=int, default=2, help="--routings: runs per mode (medians)")
    p.add_argument("--serve-args", default="", help="--routings: more `unison serve` options")
    p.set_defaults(func=main)
