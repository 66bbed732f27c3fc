"""Batch invariance: a prompt alone equals the same prompt inside a batch of 16 of different
lengths, with prefill chunked small and a KV pool so small that preemption happens."""

from __future__ import annotations

from tests.e2e.test_engine import PROMPTS, top_dicts, wait_idle
from tests.utils import assert_greedy_close
from unison import Engine

# 16 prompts of 5 to ~90 tokens.
BATCH = PROMPTS + [p + " " + " ".join(PROMPTS[: i + 1]) for i, p in enumerate(PROMPTS)]
PARAMS = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def run(engine, prompts):
    return engine.generate(prompts, PARAMS, return_logprob=True, top_logprobs_num=5)


def test_alone_equals_batched_under_chunking_and_preemption():
    # 384 KV tokens cannot hold 16 requests of ~30-110 tokens each: the scheduler must preempt.
    with Engine(chunked_prefill_size=32, max_total_tokens=384, block_size=16) as engine:
        alone = [run(engine, p) for p in BATCH]
        assert engine.get_server_info()["stats"]["num_preemptions"] == 0
        batched = run(engine, BATCH)
        info = wait_idle(engine)
        assert info["stats"]["num_preemptions"] > 0, "the small KV pool should have forced preemption"
        engine.check_integrity()
    for prompt, a, b in zip(BATCH, alone, batched):
        assert_greedy_close(a["output_ids"], top_dicts(a), b["output_ids"], top_dicts(b), name=prompt)
