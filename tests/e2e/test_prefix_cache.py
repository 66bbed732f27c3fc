"""The prefix cache with the model: reuse across turns, and identical outputs under memory pressure
where both eviction and preemption happen."""

from __future__ import annotations

from tests.e2e.test_engine import PROMPTS, top_dicts, wait_idle
from tests.utils import assert_greedy_close
from unison import Engine

PARAMS = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 5}


def test_multi_turn_chat_reuses_the_previous_turn():
    with Engine(num_threads=1) as engine:
        tok = engine.tokenizer
        turn1 = [{"role": "user", "content": "Tell me about the moon in two sentences."}]
        prompt1 = tok.encode(tok.apply_chat_template(turn1))
        reply = engine.generate(input_ids=prompt1, sampling_params={"temperature": 0, "max_new_tokens": 24})
        turn2 = turn1 + [{"role": "assistant", "content": reply["text"]},
                         {"role": "user", "content": "And about the sun?"}]
        second = engine.generate(tok.apply_chat_template(turn2), {"temperature": 0, "max_new_tokens": 8})
        assert second["meta_info"]["cached_tokens"] >= len(prompt1) // 16 * 16
        wait_idle(engine)
        engine.check_integrity()


def _requests(tokenizer) -> list[list[int]]:
    groups = [tokenizer.encode(" ".join(order) * 3)[:160] for order in (PROMPTS, PROMPTS[::-1])]
    return [g + tokenizer.encode(f" Question {i}: {PROMPTS[i]}") for g in groups for i in range(4)]


def test_outputs_are_identical_under_eviction_and_preemption():
    # 24 blocks of 16 tokens: a 10-block shared prefix plus four requests' own blocks overflow it.
    with Engine(num_threads=1, max_total_tokens=384, chunked_prefill_size=64) as engine:
        prompts = _requests(engine.tokenizer)
        cached = engine.generate(input_ids=prompts, sampling_params=PARAMS, **LOGPROBS)
        info = wait_idle(engine)
        engine.check_integrity()
    assert info["stats"]["num_preemptions"] > 0, "the small pool should force preemption"
    assert info["num_evicted_blocks"] > 0, "the small pool should force eviction"
    assert any(o["meta_info"]["cached_tokens"] > 0 for o in cached)
    with Engine(num_threads=1, disable_radix_cache=True) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=PARAMS, **LOGPROBS)
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in plain)
    for ref, got in zip(plain, cached):
        assert_greedy_close(ref["output_ids"], top_dicts(ref), got["output_ids"], top_dicts(got))


def test_a_cached_blocks_leading_tokens_are_copied_not_recomputed(model_dir):
    """A prompt that leaves a cached block partway (or repeats a cached prompt whole) reuses that
    block's leading tokens through a copy of its own: cached_tokens counts them, and the output
    is the cold run's to the bit (in-process core: block ids are visible)."""
    from unison.config import EngineConfig
    from unison.core.engine_core import EngineCore
    from unison.wire.messages import CoreSamplingParams, Generate

    def run(core: EngineCore, rid: str, tokens: list[int], n: int = 4) -> tuple[list[int], int]:
        core.add(b"fe", Generate(rid, tokens, CoreSamplingParams(max_new_tokens=n, ignore_eos=True,
                                                                  temperature=0.0)))
        ids, cached = [], 0
        while core.has_work:
            for out in core.step().get(b"fe", []):
                ids, cached = ids + out.token_ids, max(cached, out.cached_tokens)
        core.check_integrity()
        return ids, cached

    base = [(i * 7919) % 30000 + 100 for i in range(100)]  # 6 whole blocks and 4 tokens
    diverging = base[:90] + [7, 8, 9, 10, 11]  # leaves base's 6th block after 10 of its tokens
    core = EngineCore(EngineConfig(num_threads=1, max_total_tokens=64 * 16), str(model_dir))
    try:
        cold = []
        for i, prompt in enumerate((base, diverging)):
            core.flush_cache()
            cold.append(run(core, f"cold{i}", prompt)[0])
        core.flush_cache()
        run(core, "fill", base, 16)  # its 7th block, base's last 4 tokens and 12 outputs, is cached
        again, cached = run(core, "again", base)
        assert cached == len(base) - 1 and again == cold[0]  # all but the one token computed
        partial, cached = run(core, "partial", diverging)
        assert cached == 90 and partial == cold[1]
        core.scheduler.kv.copy_block = None  # without copies: whole blocks only
        _, cached = run(core, "whole", diverging)
        assert cached == 80
    finally:
        core.close()
