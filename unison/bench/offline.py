"""Offline benchmarks of the Engine API, each beside Hugging Face transformers in the same run.

`unison bench latency`: load time, prefill tok/s of one long prompt, single-stream decode tok/s.
`unison bench offline`: N requests submitted at once (seeded random token ids, or ShareGPT
conversations), fixed or ranged input / output lengths; requests/s, input / output / total tok/s,
and the linear-layer ceiling of the run with the fraction of it achieved (see ceiling.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from unison import Engine
from unison.bench import Json
from unison.bench.datasets import SampleRequest, random_ids, random_requests, sharegpt_requests
from unison.core.metrics import RECORD_STEP_SHAPES_ENV
from unison.wire.messages import GetStepShapes

if TYPE_CHECKING:  # loaded by the runs that need them
    from torch import Tensor
    from tqdm import tqdm

SamplingParams = dict[str, float | int | bool]  # Engine.generate's sampling_params, as a dict


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_ids(rng, length, vocab) for _ in range(n)]


def load_requests(args: argparse.Namespace, engine: Engine) -> list[SampleRequest]:
    """Prompts as token ids: the lengths are what both engines are given."""
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len or 128, args.range_ratio,
                               args.seed, vocab=engine.server_info().core.vocab_size)
    if not args.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path")
    tok = engine.tokenizer
    samples = sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, args.output_len,
                                count_tokens=lambda text: len(tok.encode(text, add_special_tokens=False)))
    prompts = [tok.encode(s.prompt) for s in samples]
    return [SampleRequest(ids, len(ids), s.output_len) for ids, s in zip(prompts, samples)]


def token_ids(r: SampleRequest) -> list[int]:
    """An offline request's prompt: token ids (load_requests and random_requests with a vocab)."""
    if isinstance(r.prompt, str):
        raise TypeError("an offline benchmark's prompts are token ids")
    return r.prompt


# ---- the Engine, typed by how it is called: one prompt, a list, a stream ---------------------

def generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Json]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert isinstance(outs, list)  # a list of prompts: one output each
    return outs


def stream(engine: Engine, ids: list[int], params: SamplingParams,
           lora: str | None = None) -> Iterator[Json]:
    chunks = engine.generate(input_ids=ids, sampling_params=params, stream=True, lora_path=lora)
    assert not isinstance(chunks, dict | list)  # stream=True: an iterator of chunks
    return chunks


def timed_stream(engine: Engine, ids: list[int], params: SamplingParams,
                 lora: str | None = None) -> tuple[float, float, int]:
    """When the first and the last chunk came (perf_counter seconds), and the tokens streamed."""
    first = last = 0.0
    n = 0
    for chunk in stream(engine, ids, params, lora):
        last = time.perf_counter()
        first = first or last
        n = len(chunk["output_ids"])
    return first, last, n


def _greedy(n: int) -> SamplingParams:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def _bar(total: int, unit: str, quiet: bool, desc: str) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=quiet, leave=False)


# ---- Unison ---------------------------------------------------------------------------------

def unison_latency(engine: Engine, prompt_len: int, output_len: int, seed: int,
                   decode_at_context: bool = False) -> dict[str, float]:
    """Prefill of the prompt, then decode after its first 32 tokens (`decode_at_context`: after
    all of it, each token attending over the whole context; its prefill is not timed)."""
    vocab = engine.server_info().core.vocab_size
    [prompt] = random_prompts(1, prompt_len, vocab, seed)
    engine.generate(input_ids=prompt[:16], sampling_params=_greedy(2))  # settle allocator and threads
    t0 = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params=_greedy(1))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    first, last, n = timed_stream(engine, prompt if decode_at_context else prompt[:32], _greedy(output_len))
    return {"prefill_tok_s": prompt_len / prefill, "decode_tok_s": (n - 1) / (last - first),
            "ttft_ms": 1e3 * (first - t0)}


async def _generate_all(engine: Engine, reqs: list[SampleRequest], quiet: bool,
                        ignore_eos: bool, loras: list[str | None] | None = None) -> list[Json]:
    bar = _bar(len(reqs), "req", quiet, "unison")

    async def one(r: SampleRequest, lora: str | None) -> Json:
        params = {**_greedy(r.output_len), "ignore_eos": ignore_eos}
        out = await engine.async_generate(input_ids=token_ids(r), sampling_params=params, lora_path=lora)
        assert isinstance(out, dict)  # one prompt, not streamed: its output
        bar.update(1)
        return out
    try:
        return await asyncio.gather(*(one(r, lora) for r, lora in zip(reqs, loras or [None] * len(reqs))))
    finally:
        bar.close()


def unison_throughput(engine: Engine, reqs: list[SampleRequest], quiet: bool = True,
                      ignore_eos: bool = True, loras: list[str | None] | None = None) -> dict[str, float]:
    """`loras`: the LoRA adapter of each request (None: the base model)."""
    return unison_run(engine, reqs, quiet, ignore_eos, loras)[0]


def unison_run(engine: Engine, reqs: list[SampleRequest], quiet: bool = True, ignore_eos: bool = True,
               loras: list[str | None] | None = None) -> tuple[dict[str, float], Counter[tuple[int, int]]]:
    """The run's rates, and the shapes of its steps' linears (for the ceiling)."""
    engine.generate(input_ids=token_ids(reqs[0])[:16], sampling_params=_greedy(2))
    from unison.bench import ceiling  # torch: imported only by the runs that need it

    before = engine._control(GetStepShapes()).rows  # recorded: main() sets RECORD_STEP_SHAPES_ENV
    t0 = time.perf_counter()
    outs = asyncio.run(_generate_all(engine, reqs, quiet, ignore_eos, loras))
    dt = time.perf_counter() - t0
    shapes = ceiling.subtract(engine._control(GetStepShapes()).rows, before)
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return _rates(len(reqs), sum(len(r.prompt) for r in reqs), out_tokens, dt), shapes


def _rates(n: int, input_tokens: int, output_tokens: int, seconds: float) -> dict[str, float]:
    return {"requests_s": n / seconds, "input_tok_s": input_tokens / seconds,
            "output_tok_s": output_tokens / seconds,
            "total_tok_s": (input_tokens + output_tokens) / seconds, "seconds": seconds,
            "output_tokens": output_tokens}


# ---- transformers ---------------------------------------------------------------------------

class HFBaseline:
    """transformers on the same weights and device, float32, greedy, batched with left padding."""

    def __init__(self, model_path: str | None, num_threads: int | None, quiet: bool = False,
                 device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from unison.model.weights.loader import model_file

        if quiet:
            hf_logging.disable_progress_bar()  # its weight-loading bar
            os.environ["TQDM_DISABLE"] = "1"  # and its GGUF loader's, which ignores that switch

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        path = model_file(model_path)
        # A GGUF file through transformers' own GGUF loader (dequantized to float32), as Unison's
        # "ready" also includes reading that file.
        where = {"pretrained_model_name_or_path": path} if path.is_dir() else {
            "pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval().to(device)
        self.load_s = time.perf_counter() - t0
        self.device = torch.device(device)

    def generate(self, prompts: list[list[int]], output_len: int, bar: tqdm | None = None) -> float:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        extra = {}
        if bar is not None:  # a logits processor runs once per generated token: the progress tick
            from transformers import LogitsProcessorList

            def tick(_ids: Tensor, scores: Tensor) -> Tensor:
                assert bar is not None
                bar.update(1)
                return scores
            extra["logits_processor"] = LogitsProcessorList([tick])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                min_new_tokens=output_len, do_sample=False, pad_token_id=0, **extra)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the GPU's queue, not only the launches
        return time.perf_counter() - t0

    def latency(self, prompt_len: int, output_len: int, seed: int) -> dict[str, float]:
        [prompt] = random_prompts(1, prompt_len, self.model.config.vocab_size, seed)
        self.generate([prompt[:16]], 2)
        prefill = self.generate([prompt], 1)
        t_short = self.generate([prompt[:32]], 1)
        t_long = self.generate([prompt[:32]], output_len)
        return {"prefill_tok_s": prompt_len / prefill, "decode_tok_s": (output_len - 1) / (t_long - t_short)}

    def throughput(self, reqs: list[SampleRequest], max_batch: int | None,
                   quiet: bool = True) -> dict[str, float]:
        """vLLM's HF backend: consecutive requests in batches of up to `max_batch`, each batch
        generating its longest output for every row; only the requested tokens count."""
        self.generate([token_ids(reqs[0])[:16]], 2)
        batches = [reqs[i: i + (max_batch or len(reqs))] for i in range(0, len(reqs), max_batch or len(reqs))]
        bar = _bar(sum(max(r.output_len for r in b) for b in batches), "step", quiet, "hf")
        try:
            dt = sum(self.generate([token_ids(r) for r in b], max(r.output_len for r in b), bar)
                     for b in batches)
        finally:
            bar.close()
        return _rates(len(reqs), sum(len(r.prompt) for r in reqs), sum(r.output_len for r in reqs), dt)


# ---- report ---------------------------------------------------------------------------------

def _row(name: str, ours: float, base: float | None, unit: str) -> str:
    ratio = f"  ({ours / base:.2f}x)" if base and unit.endswith("/s") else ""
    base_s = f"{base:10.1f}" if base else f"{'-':>10}"
    return f"{name:<28}{ours:10.1f}{base_s}  {unit}{ratio}"


ROWS = (("prefill_tok_s", "tok/s"), ("decode_tok_s", "tok/s"), ("ttft_ms", "ms"),
        ("requests_s", "req/s"), ("input_tok_s", "tok/s"), ("output_tok_s", "tok/s"),
        ("total_tok_s", "tok/s"), ("seconds", "s"))


def report(ours: Json, base: dict[str, float], load_s: float) -> str:
    lines = [f"unison linears: {ours.get('quantization', '?')}; hf: float32; on {ours.get('device', 'cpu')}",
             f"{'metric':<28}{'unison':>10}{'hf':>10}", _row("engine ready", load_s, base.get("load_s"), "s")]
    lines += [_row(key, ours[key], base.get(key), unit) for key, unit in ROWS if key in ours]
    if ours.get("spec_decode"):
        spec = ours["spec_decode"]
        rate = spec["num_accepted_tokens"] / max(spec["num_draft_tokens"], 1)
        per_draft = spec["num_accepted_tokens"] / max(spec["num_drafts"], 1)
        lines.append(f"speculative decoding: {spec['num_drafts']} drafts, acceptance rate {rate:.2f}, "
                     f"{per_draft:.2f} tokens accepted per draft")
    if ours.get("kv_events"):
        lines.append(f"KV events read by a subscriber: {ours['kv_events']['batches']} batches, "
                     f"{ours['kv_events']['events']} events")
    if ours.get("read_gbps"):  # one stream: the step's bytes at its decode rate, against the memory's
        gbps = ours["step_bytes"] * ours["decode_tok_s"] / 1e9
        lines.append(f"one stream: a step reads {ours['step_bytes'] / 2**20:.0f} MiB; decode reads "
                     f"{gbps:.1f} GB/s of the memory's {ours['read_gbps']:.1f} GB/s: "
                     f"{gbps / ours['read_gbps']:.2f} of the bound")
    if "ceiling_s" in ours:
        tok_s = ours["output_tokens"] / ours["ceiling_s"]
        lines.append(f"linear-layer ceiling: {tok_s:.1f} output tok/s (the GEMMs alone take "
                     f"{ours['ceiling_s']:.1f} s of the run's {ours['seconds']:.1f} s): "
                     f"{100 * ours['ceiling_s'] / ours['seconds']:.0f}% of it achieved")
    return "\n".join(lines)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:  # Engine's keywords: values of many types
    """The engine options a benchmark was given (the rest keep the engine's defaults)."""
    names = ("device", "num_threads", "quantization", "dtype", "kv_cache_dtype", "speculative_config",
             "kv_events_config")
    return {"model_path": args.model_path,
            **{n: getattr(args, n) for n in names if getattr(args, n, None) is not None}}


@contextlib.contextmanager
def _subscriber(engine: Engine, attach: bool) -> Iterator[dict[str, int]]:
    """A thread that reads the engine's KV events into an index, as a router would; yields the
    counts (filled in once the run ends)."""
    counts: dict[str, int] = {}
    if not attach:
        yield counts
        return
    import msgspec
    import zmq

    from unison.deploy.kv_index import KVIndex
    from unison.wire.kv_events import KVEventBatch

    info = engine.server_info().core.kv_events
    if info is None:
        raise ValueError("--kv-events-subscriber needs --kv-events-config with events enabled")
    stop, index, decoder = threading.Event(), KVIndex(), msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(info.endpoint)

    def read() -> None:
        while not stop.is_set():
            if sub.poll(50):
                batch = decoder.decode(sub.recv_multipart()[2])
                index.apply(0, batch.events)
                counts["batches"] = counts.get("batches", 0) + 1
                counts["events"] = counts.get("events", 0) + len(batch.events)

    thread = threading.Thread(target=read, daemon=True, name="bench-kv-subscriber")
    thread.start()
    time.sleep(0.3)  # connected before the run starts
    try:
        yield counts
    finally:
        time.sleep(0.3)
        stop.set()
        thread.join()
        sub.close(linger=0)
        ctx.term()


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cpu); the transformers "
                   "baseline runs there too")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads in the core")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default=None,
                   help="linear weights (default: auto, a GGUF at its own size)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=None,
                   help="float weights (default: auto: float32 on CPU, the checkpoint's or bfloat16 on "
                        "CUDA; bfloat16 on CPU: bf16 linears)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16", "int8"],
                   default=None, help="KV cache elements (default: auto)")
    p.add_argument("--speculative-config", default=None,
                   help='as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    p.add_argument("--kv-events-config", default=None,
                   help='publish KV events, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
                        '"tcp://127.0.0.1:*"}\'')
    p.add_argument("--kv-events-subscriber", action="store_true",
                   help="with --kv-events-config: a subscriber in this process reads every event "
                        "into an index while the benchmark runs (its cost shows in the figures)")


def main(args: argparse.Namespace) -> int:
    os.environ[RECORD_STEP_SHAPES_ENV] = "1"  # the ceiling is timed at the run's step shapes
    t0 = time.perf_counter()
    engine = Engine(**engine_options(args))
    load_s = time.perf_counter() - t0
    try:
        ours: Json  # the figures, and what they were measured on: the result file's "unison"
        shapes: Counter[tuple[int, int]] = Counter()
        if args.bench == "latency":
            ours = {**unison_latency(engine, args.prompt_len, args.output_len, args.seed,
                                     args.decode_at_context)}
        else:
            reqs = load_requests(args, engine)
            with _subscriber(engine, getattr(args, "kv_events_subscriber", False)) as events:
                rates, shapes = unison_run(engine, reqs, args.quiet, not args.no_ignore_eos)
            ours = {**rates, "kv_events": events}
        info = engine.server_info()
        ours["quantization"], ours["device"] = info.core.quantization, info.config.device
        ours["step_bytes"] = info.core.step_bytes
        ours["spec_decode"] = msgspec.to_builtins(info.stats.spec_decode)
    finally:
        engine.shutdown()
    if args.bench == "offline" and not args.no_ceiling and ours["device"] == "cpu":  # CPU GEMMs
        from unison.bench import ceiling

        ours["ceiling_s"] = ceiling.measure(args.model_path, shapes, args.num_threads,
                                            ours["quantization"])
    one_stream = args.bench == "latency" or getattr(args, "num_prompts", 0) == 1
    if one_stream and ours["device"] == "cpu" and ours["step_bytes"] and ours.get("decode_tok_s"):
        from unison.bench import bandwidth

        ours["read_gbps"] = bandwidth.measure(args.num_threads)
    base: dict[str, float] = {}
    if args.baseline == "hf":
        hf = HFBaseline(args.model_path, args.num_threads, args.quiet, ours["device"])
        base = (hf.latency(args.prompt_len, args.output_len, args.seed) if args.bench == "latency"
                else hf.throughput(reqs, args.hf_max_batch_size, args.quiet))
        base["load_s"] = hf.load_s
    print(report(ours, base, load_s))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"bench": args.bench, "args": vars(args) | {"func": None}, "unison": ours,
                       "hf": base or None, "engine_ready_s": load_s}, f, indent=2)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, helptext in (("latency", "load time, long-prompt prefill and single-stream decode"),
                           ("offline", "throughput of many requests submitted at once")):
        p = sub.add_parser(name, help=helptext)
        add_engine_arguments(p)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--baseline", choices=["none", "hf"], default="none")
        p.add_argument("--output-len", type=int, default=128 if name == "latency" else None,
                       help="new tokens per request (offline default: 128; ShareGPT: each reply's length)")
        p.add_argument("--result-file", default=None, help="write the figures as JSON here")
        p.add_argument("--quiet", action="store_true", help="no progress bars")
        if name == "latency":
            p.add_argument("--prompt-len", type=int, default=512)
            p.add_argument("--decode-at-context", action="store_true",
                           help="decode after the whole prompt (speed at that context), not after 32 tokens")
        else:
            p.add_argument("--num-prompts", type=int, default=64)
            p.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
            p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON")
            p.add_argument("--input-len", type=int, default=128)
            p.add_argument("--range-ratio", type=float, default=0.0,
                           help="random lengths uniform in [len * (1 - r), len * (1 + r)]")
            p.add_argument("--no-ignore-eos", action="store_true",
                           help="let requests stop at EOS (then output lengths vary by engine)")
            p.add_argument("--hf-max-batch-size", type=int, default=None,
                           help="transformers batch size (default: all prompts in one batch)")
            p.add_argument("--no-ceiling", action="store_true",
                           help="skip timing the linear-layer ceiling after the run (timed on CPU only)")
        p.set_defaults(func=main)
