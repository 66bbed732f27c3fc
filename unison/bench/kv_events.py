"""`unison bench kv-events`: what publishing KV events costs the core per step, with a subscriber
reading them.

One heavy step: 64 requests each storing a 512-token prefill chunk (32 blocks of 16), one
request's 8 blocks evicted; the events hashed, batched, encoded and sent on the PUB socket, as the
core does after every step.
"""

from __future__ import annotations

import argparse
import random
import threading
import time


def main(args: argparse.Namespace) -> int:
    import zmq

    from unison.config import KVEventsConfig
    from unison.core.kv.publisher import EventLog, Publisher
    from unison.wire.kv_events import block_hashes

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                         replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    log = EventLog(16)
    pub = Publisher(ctx, cfg, 0, log)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.info().endpoint)
    got = 0

    def read() -> None:
        nonlocal got
        while sub.poll(500):
            sub.recv_multipart()
            got += 1

    time.sleep(0.3)  # the subscription reaches the publisher
    reader = threading.Thread(target=read)
    reader.start()
    rng = random.Random(0)
    chunks = [tuple(rng.randrange(50000) for _ in range(512)) for _ in range(64)]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        for c in chunks:
            hashes = block_hashes(list(c), 16)  # the radix cache hashes what it adopts
            log.stored(None, hashes, c, [], 0)
        log.removed(hashes[:8])
        pub.publish()
    dt = (time.perf_counter() - t0) / args.steps
    reader.join()
    print(f"{dt * 1e3:.2f} ms per step of 64 x 32 blocks stored ({dt / 2048 * 1e6:.2f} us per block); "
          f"batches read {got}")
    pub.close()
    sub.close(0)
    ctx.term()
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kv-events", help="the core's cost per step of publishing KV events")
    p.add_argument("--steps", type=int, default=50)
    p.set_defaults(func=main)
