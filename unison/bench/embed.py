"""`unison bench embed`: sentence embeddings beside sentence-transformers, in one invocation.

    unison bench embed --model-path DIR [--num-texts 2000] [--trials 3] [--kinds float32,bfloat16,int8]
                       [--http-clients 16]

Texts are seeded random sentences of common words, 8 to 256 tokens. sentence-transformers runs
its defaults (batch 32, float32, texts sorted by length) in this process; Unison runs an Engine
per kind of linear, each started before the timing and kept for every trial; trials alternate.
With --http-clients, `unison serve` (the last kind) is loaded by that many clients, one text per
request, and its texts/s printed beside the offline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time

import numpy as np

from unison.bench.datasets import WORDS
from unison.bench.local_server import free_port, stop, wait_ready

KIND_ARGS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}


def texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of 6 to 250 words: 8 to 256 tokens with [CLS] and [SEP] (longer ones are cut)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(6, 250))).capitalize() + "." for _ in range(n)]


def offline(args: argparse.Namespace, sentences: list[str]) -> dict[str, list[float]]:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise SystemExit("unison bench embed compares with sentence-transformers: "
                         "pip install sentence-transformers") from None
    from unison import Engine

    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KIND_ARGS))
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; known: {sorted(KIND_ARGS)}")
    st = SentenceTransformer(args.model_path, device="cpu")
    engines = {k: Engine(model_path=args.model_path, chunked_prefill_size=args.chunked_prefill_size,
                         **KIND_ARGS[k]) for k in kinds}
    rates: dict[str, list[float]] = {"sentence-transformers": [], **{k: [] for k in kinds}}
    try:
        reference = st.encode(sentences, batch_size=32, convert_to_numpy=True)  # also the warm-up
        for kind, engine in engines.items():
            ours = np.array([r["embedding"] for r in engine.encode(sentences, truncate_prompt_tokens=256)])
            cos = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
            print(f"{kind}: cosine with sentence-transformers, min {cos.min():.7f}", flush=True)
        for trial in range(args.trials):
            t = time.perf_counter()
            st.encode(sentences, batch_size=32)
            rates["sentence-transformers"].append(len(sentences) / (time.perf_counter() - t))
            for kind, engine in engines.items():
                t = time.perf_counter()
                engine.encode(sentences, truncate_prompt_tokens=256)
                rates[kind].append(len(sentences) / (time.perf_counter() - t))
            line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
            print(f"trial {trial + 1}: {line}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return rates


async def _load(url: str, sentences: list[str], clients: int) -> float:
    import httpx

    queue = list(reversed(sentences))
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            while queue:
                r = await client.post(url + "/v1/embeddings", json={"input": queue.pop(),
                                                                     "truncate_prompt_tokens": 256})
                r.raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return len(sentences) / (time.perf_counter() - t)


def served(args: argparse.Namespace, sentences: list[str], kind: str) -> list[float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = {"dtype": "--dtype", "quantization": "--quantization"}
    extra = [a for k, v in KIND_ARGS[kind].items() for a in (flags[k], v)]
    proc = subprocess.Popen([sys.executable, "-m", "unison.cli", "serve", args.model_path,
                             "--port", str(port), "--tokenizer-worker-num", str(args.workers),
                             "--chunked-prefill-size", str(args.chunked_prefill_size), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(url, proc)
        asyncio.run(_load(url, sentences[:64], args.http_clients))  # warm up
        return [asyncio.run(_load(url, sentences, args.http_clients)) for _ in range(args.trials)]
    finally:
        stop(proc)


def main(args: argparse.Namespace) -> None:
    sentences = texts(args.num_texts, args.seed)
    rates = offline(args, sentences)
    base = statistics.median(rates["sentence-transformers"])
    print(f"\n{args.num_texts} texts, median of {args.trials} trials, texts/s:")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"  {name:22s} {med:8.1f}  ({', '.join(f'{v:.1f}' for v in values)})  {med / base:.2f}x")
    if args.http_clients:
        kind = args.kinds.split(",")[-1]
        values = served(args, sentences, kind)
        med = statistics.median(values)
        print(f"  unison serve ({kind}, {args.http_clients} clients, {args.workers} workers) {med:8.1f}  "
              f"({', '.join(f'{v:.1f}' for v in values)})  {med / base:.2f}x")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("embed", help="sentence embeddings beside sentence-transformers (texts/s)")
    p.add_argument("--model-path", required=True, help="a sentence-transformers BERT directory")
    p.add_argument("--num-texts", type=int, default=2000)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kinds", default="float32,bfloat16,int8",
                   help="what Unison's linears run as, comma-separated: float32, bfloat16, int8")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="tokens per step")
    p.add_argument("--http-clients", type=int, default=0, help="also load `unison serve` with this many")
    p.add_argument("--workers", type=int, default=2, help="HTTP workers of that server")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
