"""The frontend's cost per token taken apart, in one process (`unison bench frontend --parts`).

- **asyncio's floor**: 64 tasks, each awaiting a future that another thread's step resolves (one
  call_soon_threadsafe a step, as the Engine API's private loop wakes its consumers), each doing
  nothing but count: the CPU of one delivery with none of Unison's work, on asyncio's loop and on
  uvloop's.
- **the in-process path**: Unison's own per-token work, the core and its socket left out: encoded
  StepOutputs decoded, fanned out to 64 requests (incremental detokenizing, wake-ups) and read by
  64 `async for` consumers as Engine.async_generate's stream.

Both run with the step's gap (`--gap-ms`) slept between steps, as a core's step time leaves the
frontend idle: a process that sleeps between steps wakes to cold caches, so the same work costs
more per token at 10 ms than back to back. The full figure (`bench frontend`) adds the socket, the
Ack and the consumer's own loop thread.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import resource
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unison.frontend.text.tokenizer import Tokenizer

STREAMS, STEPS = 64, 128


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def floor_us(gap_s: float, new_loop: Callable[[], asyncio.AbstractEventLoop]) -> float:
    """CPU per delivery of bare task wake-ups, STREAMS tasks woken once a step from a thread."""
    loop = new_loop()
    # One future per step and stream, made up front: a step resolves its own row, so a consumer
    # still busy with the last one finds the next already done (never a result set twice).
    rows = [[loop.create_future() for _ in range(STREAMS)] for _ in range(STEPS)]

    async def consumer(i: int) -> None:
        for row in rows:
            await row[i]

    def wake(row: list[asyncio.Future]) -> None:
        for f in row:
            f.set_result(None)

    def steps() -> None:  # the core's steps, on the frontend's loop thread
        for row in rows:
            time.sleep(gap_s)
            loop.call_soon_threadsafe(wake, row)

    async def run() -> float:
        tasks = [asyncio.ensure_future(consumer(i)) for i in range(STREAMS)]
        await asyncio.sleep(0.01)  # every consumer waits on its first future
        gc.collect()
        start = _cpu()
        stepper = threading.Thread(target=steps)
        stepper.start()
        await asyncio.gather(*tasks)
        stepper.join()
        return 1e6 * (_cpu() - start) / (STREAMS * STEPS)

    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


def load_tokenizer(model_path: str | None) -> Tokenizer:
    from unison.frontend.text.tokenizer import Tokenizer
    from unison.model.weights.loader import resolve_model_dir

    return Tokenizer.from_dir(resolve_model_dir(model_path))


def in_process_us(gap_s: float, tokenizer: Tokenizer) -> tuple[float, float]:
    """(CPU per token, deliveries per token) of the fan-out and the consumers, on one loop."""
    from unison.frontend.collector import Collector
    from unison.frontend.fanout import fan_out
    from unison.frontend.request import PromptRequest, ReqState
    from unison.frontend.sampling_params import SamplingParams
    from unison.wire.messages import ReqOutput, StepOutputs, decode_to_frontend, encode

    ids = tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    prompt = PromptRequest(ids, SamplingParams(), STEPS)

    async def run() -> tuple[float, float]:
        states = [ReqState(uuid.uuid4().hex, prompt, tokenizer) for _ in range(STREAMS)]
        in_flight = {s.rid: s for s in states}
        loop, deliveries = asyncio.get_running_loop(), 0

        async def consumer(state: ReqState) -> None:
            nonlocal deliveries
            async for _ in Collector([state], False, loop, lambda rids: None).stream():
                deliveries += 1

        tasks = [asyncio.ensure_future(consumer(s)) for s in states]
        steps = [encode(StepOutputs([ReqOutput(s.rid, [100 + (7 * step + i) % 5000],
                                               finish="length" if step == STEPS - 1 else None)
                                     for i, s in enumerate(states)], step + 1)) for step in range(STEPS)]
        await asyncio.sleep(0.01)
        gc.collect()  # (the runs before left garbage: not this run's to collect)
        start = _cpu()
        for frame in steps:
            time.sleep(gap_s)  # the core's step: this process idles, as it does on its socket
            msg = decode_to_frontend(frame)
            assert isinstance(msg, StepOutputs)
            fan_out(in_flight, msg.outputs)
            await asyncio.sleep(0)  # the consumers run
        await asyncio.gather(*tasks)
        tokens = STREAMS * STEPS
        return 1e6 * (_cpu() - start) / tokens, deliveries / tokens

    return asyncio.run(run())


def _median_of(runs: int, measure: Callable[[], float]) -> tuple[float, list[float]]:
    values = [measure() for _ in range(runs)]
    return sorted(values)[len(values) // 2], values


def main(gap_ms: float, repeats: int, model_path: str | None) -> None:
    import uvloop

    gap = gap_ms / 1000
    print(f"The frontend taken apart: {STREAMS} streams x {STEPS} steps, {gap_ms:g} ms idle between "
          f"steps; CPU per token (median of {repeats})")
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [
        ("asyncio", asyncio.new_event_loop), ("uvloop", uvloop.new_event_loop)]
    for name, new_loop in loops:
        median, runs = _median_of(repeats, functools.partial(floor_us, gap, new_loop))
        print(f"  a bare wake-up from another thread ({name}): {median:6.2f} us   "
              f"runs {', '.join(f'{r:.2f}' for r in runs)}")
    tokenizer = load_tokenizer(model_path)
    results = [in_process_us(gap, tokenizer) for _ in range(repeats)]
    median = sorted(r[0] for r in results)[len(results) // 2]
    print(f"  Unison's fan-out and consumers, one loop: {median:6.2f} us   runs "
          f"{', '.join(f'{r[0]:.2f}' for r in results)}; deliveries/token "
          f"{min(r[1] for r in results):.2f}-{max(r[1] for r in results):.2f}")

