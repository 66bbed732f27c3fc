"""Offline benchmarks of the Engine API, each beside Hugging Face transformers in the same run.

`unison bench latency`: load time, prefill tok/s of one long prompt, single-stream decode tok/s.
`unison bench offline`: output tok/s of N concurrent requests with fixed input/output lengths.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from unison import Engine


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    # Ids from the ordinary part of the vocabulary: no special tokens inside prompts.
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def _greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def unison_latency(engine: Engine, prompt_len: int, output_len: int, seed: int) -> dict[str, float]:
    vocab = engine.get_server_info()["vocab_size"]
    [prompt] = random_prompts(1, prompt_len, vocab, seed)
    engine.generate(input_ids=prompt[:16], sampling_params=_greedy(2))  # settle allocator and threads
    t0 = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params=_greedy(1))
    prefill = time.perf_counter() - t0
    first = last = None
    t0 = time.perf_counter()
    for chunk in engine.generate(input_ids=prompt[:32], sampling_params=_greedy(output_len), stream=True):
        now = time.perf_counter()
        first = first or now
        last = now
        n = len(chunk["output_ids"])
    return {"prefill_tok_s": prompt_len / prefill, "decode_tok_s": (n - 1) / (last - first),
            "ttft_ms": 1e3 * (first - t0)}


def unison_throughput(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    engine.generate(input_ids=prompts[0][:16], sampling_params=_greedy(2))
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=_greedy(output_len))
    dt = time.perf_counter() - t0
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"output_tok_s": out_tokens / dt, "requests_s": len(prompts) / dt, "seconds": dt}


class HFBaseline:
    """transformers on the same weights, greedy, batched with left padding."""

    def __init__(self, model_dir: str, num_threads: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], output_len: int) -> float:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    def latency(self, prompt_len: int, output_len: int, seed: int) -> dict[str, float]:
        [prompt] = random_prompts(1, prompt_len, self.model.config.vocab_size, seed)
        self.generate([prompt[:16]], 2)
        prefill = self.generate([prompt], 1)
        t_short = self.generate([prompt[:32]], 1)
        t_long = self.generate([prompt[:32]], output_len)
        return {"prefill_tok_s": prompt_len / prefill, "decode_tok_s": (output_len - 1) / (t_long - t_short)}

    def throughput(self, prompts: list[list[int]], output_len: int) -> dict[str, float]:
        self.generate([prompts[0][:16]], 2)
        dt = self.generate(prompts, output_len)
        n = len(prompts)
        return {"output_tok_s": n * output_len / dt, "requests_s": n / dt, "seconds": dt}


def _row(name: str, ours: float, base: float | None, unit: str) -> str:
    ratio = f"  ({ours / base:.2f}x)" if base else ""
    base_s = f"{base:10.1f}" if base else f"{'-':>10}"
    return f"{name:<28}{ours:10.1f}{base_s}  {unit}{ratio}"


def main(args: argparse.Namespace) -> int:
    opts = {"num_threads": args.num_threads} if args.num_threads else {}
    t0 = time.perf_counter()
    engine = Engine(model_path=args.model_path, **opts)
    load_s = time.perf_counter() - t0
    try:
        if args.bench == "latency":
            ours = unison_latency(engine, args.prompt_len, args.output_len, args.seed)
        else:
            prompts = random_prompts(args.num_prompts, args.input_len,
                                     engine.get_server_info()["vocab_size"], args.seed)
            ours = unison_throughput(engine, prompts, args.output_len)
        model_dir = engine.model_dir
    finally:
        engine.shutdown()
    base: dict[str, float] = {}
    if args.baseline == "hf":
        hf = HFBaseline(model_dir, args.num_threads)
        base = (hf.latency(args.prompt_len, args.output_len, args.seed) if args.bench == "latency"
                else hf.throughput(prompts, args.output_len))
        base["load_s"] = hf.load_s
    print(f"{'metric':<28}{'unison':>10}{'hf':>10}")
    print(_row("engine ready", load_s, base.get("load_s"), "s"))
    for key, unit in (("prefill_tok_s", "tok/s"), ("decode_tok_s", "tok/s"), ("ttft_ms", "ms"),
                      ("output_tok_s", "tok/s"), ("requests_s", "req/s"), ("seconds", "s")):
        if key in ours:
            print(_row(key, ours[key], base.get(key), unit))
    return 0


def add_parser(sub: Any) -> None:
    for name, helptext in (("latency", "load time, long-prompt prefill and single-stream decode"),
                           ("offline", "output throughput of many concurrent requests")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model-path", default=None)
        p.add_argument("--num-threads", type=int, default=None)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--baseline", choices=["none", "hf"], default="none")
        p.add_argument("--output-len", type=int, default=128)
        if name == "latency":
            p.add_argument("--prompt-len", type=int, default=512)
        else:
            p.add_argument("--num-prompts", type=int, default=64)
            p.add_argument("--input-len", type=int, default=128)
        p.set_defaults(func=main)
