"""Admission across frontends: with `fair` a frontend that floods the engine cannot starve another;
with `fcfs` the later frontend waits behind the flood. Order is read from the core's record."""

from __future__ import annotations

import os
import threading
import time

import pytest

from unison import Engine

FLOOD = 100
LONG = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}
SHORT = {"max_new_tokens": 2, "temperature": 0}


def _flood(engine: Engine) -> list:
    streams = [engine.generate("Once upon a time", LONG, stream=True) for _ in range(FLOOD)]
    return streams


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_flooding_frontend_does_not_starve_another(policy):
    with Engine(num_threads=1, tokenizer_worker_num=2, max_running_requests=2,
                schedule_policy=policy) as a:
        b = Engine.attach_tokenizer_worker(os.getpid())
        try:
            streams = _flood(a)  # A queues 100 long requests...
            time.sleep(0.3)
            done = threading.Event()
            t = threading.Thread(target=lambda: (b.generate(["1 + 1 ="] * 4, SHORT), done.set()))
            t.start()  # ...then B sends 4 short ones
            b_id = b.get_server_info()["worker_id"]
            if policy == "fair":
                assert done.wait(60), "B's requests should finish while A's queue is still long"
                info = a.get_server_info()
                order = [wid for wid, _ in info["admissions"]]
                # Round-robin: B's four are admitted within the next eight admissions.
                b_at = [i for i, wid in enumerate(order) if wid == b_id]
                assert len(b_at) == 4 and b_at[-1] - b_at[0] <= 8, order
                assert info["num_waiting"] > FLOOD // 2
            else:
                time.sleep(5)  # long enough for B to be admitted, were it not queued behind A
                order = [wid for wid, _ in a.get_server_info()["admissions"]]
                assert b_id not in order and not done.is_set(), order
            for s in streams:
                s.close()  # aborts A's requests; under fcfs B then runs
            t.join(30)
            assert done.is_set()
        finally:
            b.shutdown()
