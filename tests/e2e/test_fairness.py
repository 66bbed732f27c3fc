"""Admission across frontends: with `fair` a frontend that floods the engine cannot starve another;
with `fcfs` the later frontend waits behind the flood. Order is read from the core's record."""

from __future__ import annotations

import os
import threading

import pytest

from tests.utils import wait_until
from unison import Engine

FLOOD = 100
LONG = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}
SHORT = {"max_new_tokens": 2, "temperature": 0}


def _flood(engine: Engine) -> list:
    streams = [engine.generate("Once upon a time", LONG, stream=True) for _ in range(FLOOD)]
    return streams


def in_flight(engine: Engine, worker_id: int) -> int:
    """The requests one frontend has in the core, waiting or running."""
    return sum(fe["requests_in_flight"] for fe in engine.get_server_info()["frontends"]
               if fe["worker_id"] == worker_id)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_flooding_frontend_does_not_starve_another(policy):
    with Engine(num_threads=1, tokenizer_worker_num=2, max_running_requests=2,
                schedule_policy=policy) as a:
        b = Engine.attach_tokenizer_worker(os.getpid())
        try:
            a_id, b_id = a.get_server_info()["worker_id"], b.get_server_info()["worker_id"]
            streams = _flood(a)  # A queues 100 long requests...
            wait_until(lambda: in_flight(a, a_id) == FLOOD, 10, "A's requests to reach the core")
            done = threading.Event()
            t = threading.Thread(target=lambda: (b.generate(["1 + 1 ="] * 4, SHORT), done.set()))
            t.start()  # ...then B sends 4 short ones
            if policy == "fair":
                assert done.wait(60), "B's requests should finish while A's queue is still long"
                info = a.get_server_info()
                order = [wid for wid, _ in info["admissions"]]
                # Round-robin: B's four are admitted within the next eight admissions.
                b_at = [i for i, wid in enumerate(order) if wid == b_id]
                assert len(b_at) == 4 and b_at[-1] - b_at[0] <= 8, order
                assert info["num_waiting"] > FLOOD // 2
            else:
                wait_until(lambda: in_flight(a, b_id) == 4, 10, "B's requests to reach the core")
                queued_at = len(a.get_server_info()["admissions"])

                def passed_over() -> bool:
                    order = [wid for wid, _ in a.get_server_info()["admissions"]]
                    assert b_id not in order and not done.is_set(), order
                    return len(order) >= queued_at + 4

                # Were the policy fair, B's first request would be the very next admission.
                wait_until(passed_over, 60, "four admissions after B's requests were queued")
            for s in streams:
                s.close()  # aborts A's requests; under fcfs B then runs
            t.join(30)
            assert done.is_set()
        finally:
            b.shutdown()
