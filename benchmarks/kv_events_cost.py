"""What publishing KV events costs the core per step, with a subscriber reading them.

One heavy step: 64 requests each storing a 512-token prefill chunk (32 blocks of 16), one
request's 8 blocks evicted; the events hashed, batched, encoded and sent on the PUB socket, as the
core does after every step. Run: python benchmarks/kv_events_cost.py
"""

import random
import threading
import time

import zmq

from unison.config import KVEventsConfig
from unison.core.kv_publisher import EventLog, Publisher

cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                     replay_endpoint="tcp://127.0.0.1:*")
ctx = zmq.Context()
log = EventLog(16)
pub = Publisher(ctx, cfg, 0, log)
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(pub.info().endpoint)
got = [0]


def read() -> None:
    while sub.poll(500):
        sub.recv_multipart()
        got[0] += 1


time.sleep(0.3)
t = threading.Thread(target=read)
t.start()
rng = random.Random(0)
chunks = [tuple(rng.randrange(50000) for _ in range(512)) for _ in range(64)]
steps, t0 = 50, time.perf_counter()
for _ in range(steps):
    for c in chunks:
        h = log.stored(None, c, 0)
    log.removed(h[:8])
    pub.publish()
dt = (time.perf_counter() - t0) / steps
t.join()
print(f"{dt * 1e3:.2f} ms per step of 64 x 32 blocks stored ({dt / 2048 * 1e6:.2f} us per block); "
      f"batches read {got[0]}")
pub.close()
sub.close(0)
ctx.term()
