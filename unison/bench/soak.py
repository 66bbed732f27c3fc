"""`unison bench soak`: a bounded soak of `unison serve` under many clients, some of them leaving.

Starts `unison serve` on 127.0.0.1 with N frontend workers, takes each spot-check prompt's solo
greedy output (one request at a time), then sends the load from `clients` concurrent clients:
streaming and non-streaming completions at temperature 0, each of a spot-check prompt, so every
completed request is compared to its solo run. A seeded `disconnect` fraction of the requests
closes the connection at a random point (after k stream chunks, or after a random time). It fails
on a request that did not complete correctly, a greedy output that differs from its solo run
other than at a near-tie, an error in the server's log, a process whose RSS grew more than a bound
after the baseline (`min(500, requests / 2)` requests), a KV pool not empty when idle, or a server
that does not exit 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from unison.bench import Json
from unison.bench.local_server import free_port
from unison.wire import registry
from unison.wire.messages import ServerInfo

if TYPE_CHECKING:  # loaded when the soak runs
    import httpx
    from tqdm import tqdm

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "In 1969, the first humans",
    "A haiku about the sea:",
)
COMPLETIONS = "/v1/completions"
TOP_N = 5
MAX_GAP = 0.1  # a divergence is tolerated only where the solo run's top-2 logprobs are this close
# uvicorn writes "ERROR:    ...", the logging module "... name[pid] ERROR message"
ERROR_LINE = re.compile(r"(^|\s)(ERROR|CRITICAL)(:|\s)|Traceback")
MIB = 1 << 20
VERDICTS = ("exact", "near-tie", "wrong")


@dataclass
class Plan:
    """One request: which prompt, how long, and when (if ever) its client walks away."""
    prompt: int
    max_tokens: int
    stream: bool
    cut: float | None = None  # stream: chunks read before closing; else seconds before closing


@dataclass
class Output:
    tokens: list[str] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)
    finish: str | None = None
    completion_tokens: int | None = None


@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0
    failed: int = 0
    output_tokens: int = 0
    greedy: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERDICTS, 0))
    reasons: list[str] = field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.failed += 1
        self.reasons.append(reason)


def make_plans(n: int, prompts: int, min_tokens: int, max_tokens: int, disconnect: float,
               seed: int) -> list[Plan]:
    """Seeded: a quarter non-streaming; exactly round(n * disconnect) requests cut at random."""
    rng = random.Random(seed)
    plans = [Plan(rng.randrange(prompts), rng.randint(min_tokens, max_tokens), rng.random() >= 0.25)
             for _ in range(n)]
    for p in rng.sample(plans, round(n * disconnect)):
        p.cut = rng.randint(0, p.max_tokens) if p.stream else rng.uniform(0.01, 3.0)
    return plans


def _top(logprobs: dict[str, float]) -> list[str]:
    return sorted(logprobs, key=logprobs.__getitem__, reverse=True)[:TOP_N]


def greedy_verdict(solo: Output, got: Output, expected_len: int) -> tuple[str, str | None]:
    """("exact" | "near-tie" | "wrong", why wrong): tests/utils.py assert_greedy_close on strings.

    Batching changes fp32 rounding, so a near-tie may flip: at the first differing position the
    solo run's top-2 gap must be < MAX_GAP and each side's token in the other's top-5. Nothing
    after that position is compared.
    """
    for i, (r, g) in enumerate(zip(solo.tokens, got.tokens)):
        if r == g:
            continue
        ranked = _top(solo.top[i])
        gap = solo.top[i][ranked[0]] - solo.top[i][ranked[1]] if len(ranked) > 1 else float("inf")
        if gap < MAX_GAP and g in ranked and r in _top(got.top[i] or {}):
            return "near-tie", None
        return "wrong", f"token {i}: solo {r!r}, got {g!r}, solo top-2 gap {gap:.3f}"
    if len(got.tokens) != expected_len:
        return "wrong", f"{len(got.tokens)} tokens, the solo run's prefix gives {expected_len}"
    return "exact", None


def check(plan: Plan, solo: Output, got: Output, tally: Tally) -> None:
    """Tallies a completed request: its shape, then its tokens against the solo run."""
    n = len(got.tokens)
    if got.finish not in ("length", "stop") or got.completion_tokens != n or \
            (got.finish == "length" and n != plan.max_tokens) or n > plan.max_tokens:
        tally.fail(f"finish {got.finish}, usage {got.completion_tokens}, {n} logprob tokens, "
                   f"max_tokens {plan.max_tokens}")
        return
    tally.completed += 1
    tally.output_tokens += n
    verdict, why = greedy_verdict(solo, got, min(plan.max_tokens, len(solo.tokens)))
    tally.greedy[verdict] += 1
    if why:
        tally.reasons.append(f"prompt {plan.prompt}, max_tokens {plan.max_tokens}: {why}")


def _absorb(out: Output, msg: Json) -> None:
    for choice in msg.get("choices") or []:
        lp = choice.get("logprobs") or {}
        out.tokens += lp.get("tokens") or []
        out.top += lp.get("top_logprobs") or []
        out.finish = choice.get("finish_reason") or out.finish
    if msg.get("usage"):
        out.completion_tokens = msg["usage"]["completion_tokens"]


def _body(prompt: str, max_tokens: int, stream: bool) -> Json:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP_N,
            "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {})


async def send(client: httpx.AsyncClient, prompt: str, plan: Plan) -> Output | str | None:
    """The output; None when the client walked away as planned; else what went wrong."""
    body = _body(prompt, plan.max_tokens, plan.stream)
    if not plan.stream:
        try:
            r = await asyncio.wait_for(client.post(COMPLETIONS, json=body), plan.cut)
        except asyncio.TimeoutError:
            return None
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:200]}"
        _absorb(out := Output(), r.json())
        return out
    out, chunks = Output(), 0
    async with client.stream("POST", COMPLETIONS, json=body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if plan.cut is not None and chunks >= plan.cut:
                return None  # leaving the block closes the connection mid-stream
            if not line.startswith("data:"):
                continue
            if (data := line[5:].strip()) == "[DONE]":
                return out
            msg = json.loads(data)
            if msg.get("error"):
                return f"stream error: {msg['error']}"
            _absorb(out, msg)
            chunks += 1
    return "the stream ended without [DONE]"


# ---- the server ------------------------------------------------------------------------------

def rss(pid: int) -> int:
    """Resident bytes of a process (0 once it is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    try:
        import psutil
    except ImportError:
        return 0
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).memory_info().rss
    return 0


class Server:
    """`unison serve` in its own session: SIGTERM to the launcher, SIGKILL to all of it if need be."""

    def __init__(self, workers: int, args: list[str], log_path: str) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(log_path, "w")  # noqa: SIM115 -- closed in stop()
        cmd = [sys.executable, "-m", "unison.cli", "serve", "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--tokenizer-worker-num", str(workers), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def info(self) -> ServerInfo:
        r = self.http.get("/get_server_info")
        r.raise_for_status()
        return ServerInfo.from_dict(r.json())

    def wait_ready(self, workers: int, timeout: float) -> ServerInfo:
        import httpx

        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError, httpx.HTTPStatusError):
                if len((info := self.info()).frontends) == workers:
                    return info
            time.sleep(0.2)
        raise RuntimeError(f"the server did not get ready (exit code {self.proc.poll()}); see its log")

    def wait_idle(self, timeout: float) -> tuple[bool, ServerInfo]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if info.num_running == info.num_waiting == info.kv_blocks_used == 0:
                return True, info
            if time.monotonic() > deadline:
                return False, info
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the launcher; its exit code, None when it did not exit within `timeout`."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout)
        return None

    def left_behind(self, pids: dict[str, int], timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while (alive := sorted(n for n, p in pids.items() if registry.pid_alive(p))) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        return alive

    def clean_up(self) -> None:
        """Whatever of it is left (a core or worker orphaned by a killed launcher): the group
        outlives its leader while any member runs. Then the files a SIGKILL leaves."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        self.log.close()
        for path in glob.glob(f"{registry.registry_path(self.proc.pid)}*"):
            registry.unlink(path)
        for path in glob.glob(f"{tempfile.gettempdir()}/unison-{self.proc.pid}-*"):
            shutil.rmtree(path, ignore_errors=True)


# ---- the run ---------------------------------------------------------------------------------

def _sample(pids: dict[str, int]) -> dict[str, int]:  # bytes
    return {name: rss(pid) for name, pid in pids.items()}


async def solo_runs(url: str, max_tokens: int) -> list[Output]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        outs = []
        for prompt in PROMPTS:
            got = await send(client, prompt, Plan(0, max_tokens, stream=False))
            if not isinstance(got, Output):
                raise RuntimeError(f"the solo run of {prompt!r} failed: {got}")
            outs.append(got)
        return outs


async def load(url: str, plans: list[Plan], solos: list[Output], clients: int, tally: Tally,
               bar: tqdm | None) -> float:
    """Every plan through `clients` concurrent clients, into the tally; the seconds it took."""
    import httpx

    todo = iter(plans)

    async def client_loop(client: httpx.AsyncClient) -> None:
        for plan in todo:
            try:
                got = await send(client, PROMPTS[plan.prompt], plan)
            except Exception as e:  # a failed request is a result, not the end of the run
                got = f"{type(e).__name__}: {e}"
            if got is None:
                tally.disconnected += 1
            elif isinstance(got, str):
                tally.fail(f"prompt {plan.prompt}, max_tokens {plan.max_tokens}: {got}")
            else:
                check(plan, solos[plan.prompt], got, tally)
            if bar is not None:
                bar.update(1)

    limits = httpx.Limits(max_connections=4 * clients, max_keepalive_connections=clients)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0, connect=30.0),
                                 limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return time.perf_counter() - t0


def soak_phases(server: Server, plans: list[Plan], clients: int, baseline_at: int,
                pids: dict[str, int], idle_timeout: float, progress: bool) -> Json:
    """The load in two parts with an idle server between them, where the baseline RSS is taken:
    idle against idle, because under load the core's heap moves by tens of MiB from one step to
    the next (the activations of each batch shape come and go)."""
    solos = asyncio.run(solo_runs(server.url, max(p.max_tokens for p in plans)))
    tally, duration, not_idle = Tally(), 0.0, []
    rss_mib: dict[str, dict[str, float]] = {}  # process -> baseline, end, growth
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plans), unit="req")
    try:
        for part, name in ((plans[:baseline_at], "baseline"), (plans[baseline_at:], "end")):
            duration += asyncio.run(load(server.url, part, solos, clients, tally, bar))
            idle, state = server.wait_idle(idle_timeout)
            info = msgspec.to_builtins(state)  # the report is JSON
            if not idle:
                not_idle.append(info)
            for proc, rss_bytes in _sample(pids).items():
                rss_mib.setdefault(proc, {})[name] = rss_bytes / MIB
    finally:
        if bar is not None:
            bar.close()
    for m in rss_mib.values():
        m["growth"] = m["end"] - m["baseline"]
    return {"tally": tally, "duration_s": duration, "rss_mib": rss_mib,
            "idle_ok": not not_idle, "not_idle": not_idle, "idle_info": info}


def run_soak(requests: int, clients: int = 64, workers: int = 4, disconnect: float = 0.1,
             seed: int = 0, min_tokens: int = 8, max_tokens: int = 32, max_rss_growth_mib: float = 64.0,
             kv_tokens: int = 4096, server_args: tuple[str, ...] = (), log_path: str | None = None,
             progress: bool = False, idle_timeout: float = 10.0) -> Json:
    """The soak; its report, whose `problems` is empty when it passed.

    The KV pool's pages become resident as its blocks are first used, so a pool of the default
    size (GiBs) would grow the core with each block first used, for most of the run. `kv_tokens`
    sizes it to be all in use long before the baseline: what grows after it is not the pool.
    """
    if requests < 2 or not 1 <= min_tokens <= max_tokens or not 0 <= disconnect <= 1:
        raise ValueError("need requests >= 2, 1 <= min_tokens <= max_tokens, 0 <= disconnect <= 1")
    plans = make_plans(requests, len(PROMPTS), min_tokens, max_tokens, disconnect, seed)
    baseline_at = min(500, requests // 2)
    report: Json = {
        "config": {"requests": requests, "clients": clients, "workers": workers,
                   "disconnect": disconnect, "seed": seed, "min_tokens": min_tokens,
                   "max_tokens": max_tokens, "max_rss_growth_mib": max_rss_growth_mib,
                   "kv_tokens": kv_tokens, "server_args": list(server_args),
                   "baseline_after": baseline_at, "idle_timeout": idle_timeout},
        "log": log_path}
    log_file = log_path
    if log_file is None:  # a temporary one: what matters of it goes into the report
        fd, log_file = tempfile.mkstemp(prefix="soak-", suffix=".log")
        os.close(fd)
    server = Server(workers, ["--max-total-tokens", str(kv_tokens), *server_args], log_file)
    pids = {"launcher": server.proc.pid}
    try:
        info = server.wait_ready(workers, timeout=300)
        pids |= {"core": info.core_pid, **{f"worker {f.pid}": f.pid for f in info.frontends}}
        phases = soak_phases(server, plans, clients, baseline_at, pids, idle_timeout, progress)
    except BaseException:
        print(f"the end of the server's log:\n{_tail(log_file)}", file=sys.stderr)
        raise
    finally:
        report["exit_code"] = server.stop()
        report["left_behind"] = server.left_behind(pids)
        server.clean_up()
        log_text = Path(log_file).read_text(errors="replace")
        if log_path is None:
            os.unlink(log_file)
    tally, duration = phases.pop("tally"), phases["duration_s"]
    report |= phases | {
        "sent": requests, "completed": tally.completed, "disconnected": tally.disconnected,
        "failed": tally.failed, "reasons": tally.reasons[:10], "greedy": tally.greedy,
        "output_tokens": tally.output_tokens,
        "request_throughput": (tally.completed + tally.disconnected + tally.failed) / duration,
        "output_throughput": tally.output_tokens / duration,
        "log_errors": [line for line in log_text.splitlines() if ERROR_LINE.search(line)]}
    report["problems"] = problems(report, tally)
    return report


def _tail(path: str, n: int = 40) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


def problems(r: Json, tally: Tally) -> list[str]:
    c, out = r["config"], []
    if tally.failed:
        out.append(f"{tally.failed} request(s) failed")
    if tally.greedy["wrong"]:
        out.append(f"{tally.greedy['wrong']} greedy output(s) differ from their solo runs")
    if tally.completed + tally.disconnected + tally.failed != r["sent"]:
        out.append("not every request was accounted for")
    grown = [f"{name} +{m['growth']:.1f} MiB" for name, m in r["rss_mib"].items()
             if m["growth"] > c["max_rss_growth_mib"]]
    if grown:
        out.append(f"RSS grew more than {c['max_rss_growth_mib']:g} MiB: {', '.join(grown)}")
    if not r["idle_ok"]:
        out.append(f"not idle within {c['idle_timeout']:g} s of the load: {r['not_idle']}")
    if r["log_errors"]:
        out.append(f"{len(r['log_errors'])} error line(s) in the server log")
    if r["exit_code"] != 0:
        out.append(f"the server exited with {r['exit_code']} on SIGTERM (None: it did not exit)")
    if r["left_behind"]:
        out.append(f"processes left behind: {r['left_behind']}")
    return out


def format_report(r: Json) -> str:
    c, g, i = r["config"], r["greedy"], r["idle_info"]
    lines = [f"{' Soak Result ':=^64}",
             f"{c['requests']} requests, {c['clients']} clients, {c['workers']} workers, "
             f"{c['disconnect']:.0%} disconnecting, max_tokens {c['min_tokens']}..{c['max_tokens']}",
             f"sent {r['sent']}  completed {r['completed']}  disconnected {r['disconnected']}  "
             f"failed {r['failed']}",
             f"greedy vs solo: exact {g['exact']}  near-tie {g['near-tie']}  wrong {g['wrong']}",
             f"duration {r['duration_s']:.1f} s  {r['request_throughput']:.2f} req/s  "
             f"{r['output_throughput']:.1f} output tok/s",
             f"KV pool {c['kv_tokens']} tokens: {i.get('num_evicted_blocks')} blocks evicted, "
             f"{i.get('stats', {}).get('num_preemptions')} preemptions",
             f"RSS (MiB), idle after {c['baseline_after']} requests -> idle at the end:"]
    for name, m in r["rss_mib"].items():
        lines.append(f"  {name:<16}{m['baseline']:9.1f} -> {m['end']:9.1f}   {m['growth']:+7.1f}")
    lines.append(f"idle afterwards: {'yes' if r['idle_ok'] else 'NO'}   exit code on SIGTERM: "
                 f"{r['exit_code']}   log error lines: {len(r['log_errors'])}")
    lines += [f"  log: {line}" for line in r["log_errors"][:10]]
    lines += [f"  reason: {why}" for why in r["reasons"]]
    lines.append("PASS" if not r["problems"] else "FAIL: " + "; ".join(r["problems"]))
    lines.append("=" * 64)
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    server_args = shlex.split(args.server_args)
    if args.model_path:
        server_args += ["--model-path", args.model_path]
    if args.num_threads:
        server_args += ["--num-threads", str(args.num_threads)]
    report = run_soak(args.requests, args.clients, args.workers, args.disconnect, args.seed,
                      args.min_tokens, args.max_tokens, args.max_rss_growth_mib, args.max_total_tokens,
                      tuple(server_args), args.log_file, progress=not args.quiet)
    print(format_report(report))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **report}, f, indent=1)
    return 1 if report["problems"] else 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("soak", help="soak unison serve: many clients, disconnects, memory, logs")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--workers", type=int, default=4, help="--tokenizer-worker-num of the server")
    p.add_argument("--disconnect", type=float, default=0.1, help="fraction of clients that leave")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-tokens", type=int, default=8, help="max_tokens drawn from min..max")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                   help="per process: peak RSS at the end against the peak before the baseline")
    p.add_argument("--max-total-tokens", type=int, default=4096,
                   help="the server's KV pool: small enough to be all touched before the baseline")
    p.add_argument("--model-path", default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads in the core")
    p.add_argument("--server-args", default="", help="more `unison serve` flags, one string")
    p.add_argument("--log-file", default=None, help="keep the server's log here")
    p.add_argument("--result-file", default=None, help="write the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)
