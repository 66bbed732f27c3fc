"""Speculative decoding (prompt lookup) against plain decoding: outputs and logprobs bit for bit,
alone and batched, through chunked prefill, prefix-cache hits, preemption, stop strings, seeded
sampling and grammars; drafts' KV rolled back; the options and counters as vLLM spells them."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from tests.e2e.test_engine import wait_idle
from unison import Engine
from unison.bench.datasets import GROUNDED_KINDS, WORDS, grounded_prompt
from unison.config import EngineConfig, SpeculativeConfig
from unison.core.spec_decode import Drafter, propose
from unison.server.metrics import render_metrics
from unison.wire.messages import GetServerInfo, ServerInfo

# Drafts even in full batches, and from single-token matches: the tests are about exactness
# (many drafts, many rejected), not about when drafting pays.
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}
ENGINE = {"chunked_prefill_size": 64, "max_running_requests": 32}
NEW = 48


@pytest.fixture(scope="module")
def plain():
    with Engine(**ENGINE) as e:
        yield e


@pytest.fixture(scope="module")
def spec():
    with Engine(**ENGINE, speculative_config=SPEC) as e:
        yield e


@pytest.fixture(autouse=True)
def integrity(request):
    yield
    for name in ("plain", "spec"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            wait_idle(engine)
            engine.check_integrity()


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    """16 input-grounded chats (drafts mostly right) and 16 random-word texts (mostly wrong)."""
    rng, tok = random.Random(7), plain.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": grounded_prompt(kind, rng)}])
             for kind in GROUNDED_KINDS * 4]
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(8, 90))) for _ in range(16)]
    return [tok.encode(t, add_special_tokens=False) for t in chats] + [tok.encode(t) for t in texts]


def run(engine: Engine, prompts: list[list[int]], **params) -> list[dict]:
    sampling = {"temperature": 0, "max_new_tokens": NEW} | params
    return engine.generate(input_ids=prompts, sampling_params=sampling, return_logprob=True,
                           top_logprobs_num=3)


def same(a: dict, b: dict) -> bool:
    keys = ("output_token_logprobs", "output_top_logprobs", "finish_reason")
    return a["output_ids"] == b["output_ids"] and all(a["meta_info"][k] == b["meta_info"][k] for k in keys)


def accepted(engine: Engine) -> int:
    return engine.get_server_info()["stats"]["spec_decode"]["num_accepted_tokens"]


def test_greedy_outputs_and_logprobs_are_bit_identical_batched_and_alone(plain, spec, prompts):
    before = accepted(spec)
    want = run(plain, prompts)
    got = run(spec, prompts)
    assert [i for i, (a, b) in enumerate(zip(want, got)) if not same(a, b)] == []
    assert accepted(spec) - before > 4 * len(prompts), "the drafts should mostly hold on these prompts"
    for i in (0, 1, 2, 3, 16, 17):  # alone: a step of one request
        assert same(run(spec, [prompts[i]])[0], want[i]), i


def test_prefix_cache_hits_and_chunked_prefill(plain, spec, prompts):
    """The same prompts again hit the prefix cache (blocks a request wrote while drafting among
    them) and their long prompts prefill in 64-token chunks: still plain decoding's outputs."""
    want = run(plain, prompts[:8])
    again = run(spec, prompts[:8])
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    assert all(same(a, b) for a, b in zip(want, again))
    # The whole sequence as a new prompt: every cached block holds the real tokens' KV, none of a
    # rejected draft's, so the next token's logprobs are plain decoding's.
    longer = [p + o["output_ids"] for p, o in zip(prompts[:8], again)]
    want, got = run(plain, longer, max_new_tokens=1), run(spec, longer, max_new_tokens=1)
    assert all(o["meta_info"]["cached_tokens"] >= len(p) - 16 for p, o in zip(prompts[:8], got))
    assert all(same(a, b) for a, b in zip(want, got))


def test_preemption_under_a_tiny_kv_cache(plain, prompts):
    want = run(plain, prompts[:12])
    with Engine(**ENGINE, speculative_config=SPEC, max_total_tokens=1024) as tiny:
        got = run(tiny, prompts[:12])
        info = wait_idle(tiny)
        tiny.check_integrity()
    assert info["stats"]["num_preemptions"] > 0 and info["stats"]["spec_decode"]["num_accepted_tokens"] > 0
    assert all(same(a, b) for a, b in zip(want, got))


def test_stop_strings_and_stop_tokens_inside_accepted_runs(plain, spec, prompts):
    repeat, greedy = prompts[0], {"temperature": 0, "max_new_tokens": NEW}  # "repeat this text"
    whole = plain.generate(input_ids=repeat, sampling_params=greedy)
    words, ids = whole["text"].split(), whole["output_ids"]
    stop = " ".join(words[len(words) // 2: len(words) // 2 + 2])
    for params in ({"stop": stop}, {"stop_token_ids": [ids[len(ids) // 2]]}, {"max_new_tokens": 13}):
        want = plain.generate(input_ids=repeat, sampling_params=greedy | params)
        got = spec.generate(input_ids=repeat, sampling_params=greedy | params)
        assert got["text"] == want["text"] and len(got["text"]) < len(whole["text"])
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_seeded_sampling_is_plain_decodings_own(plain, spec, prompts):
    """Verification samples each row as plain decoding samples that step (same noise), so a seeded
    request gives plain decoding's output, alone or batched with others."""
    params = {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 11, "frequency_penalty": 0.3}
    want = run(plain, prompts[:8], **params)
    assert all(same(a, b) for a, b in zip(want, run(spec, prompts[:8], **params)))
    assert same(run(spec, [prompts[2]], **params)[0], want[2])


def test_sampled_token_distribution_is_unchanged(plain, spec):
    """A 2-token-step toy: prompt "x y z x y z ... x y", top_k 5. Draws of the token after a given
    first token, with drafts verified, follow the model's own probabilities (chi-square), and equal
    plain decoding's draws seed by seed. The prompt is one KV block and a token: after the first
    wave each draw prefills one token, its block a prefix-cache hit (the test's time halves)."""
    tok = plain.tokenizer
    prompt = tok.encode(" cat dog bird" * 5 + " cat dog", add_special_tokens=False)
    assert len(prompt) == 17
    params = {"temperature": 1.0, "top_k": 5, "max_new_tokens": 3}

    def draw(engine: Engine) -> list[list[int]]:
        # In waves as large as a batch: no queue left to admit, so each step's token budget has
        # room for the drafts.
        waves = [[params | {"sampling_seed": seed + i} for i in range(32)] for seed in range(0, 640, 32)]
        return [o["output_ids"] for wave in waves
                for o in engine.generate(input_ids=[prompt] * 32, sampling_params=wave)]
    before = spec.get_server_info()["stats"]["spec_decode"]["num_drafts"]
    got = draw(spec)
    assert spec.get_server_info()["stats"]["spec_decode"]["num_drafts"] - before > 100, "the toy should draft"
    assert got == draw(plain)
    first = Counter(ids[0] for ids in got).most_common(1)[0][0]
    second = Counter(ids[1] for ids in got if ids[0] == first)
    top = plain.generate(input_ids=prompt + [first], sampling_params={"max_new_tokens": 1},
                         return_logprob=True, top_logprobs_num=5)["meta_info"]["output_top_logprobs"][0]
    mass = sum(math.exp(lp) for lp, _, _ in top)
    n = sum(second.values())
    assert sum(second[t] for _, t, _ in top) == n  # top_k 5: nothing outside the model's top 5
    # Pearson's chi-square over the tokens expected 5 times or more, the rarer ones pooled as one
    expected = {tid: n * math.exp(lp) / mass for lp, tid, _ in top}
    cells = [(second.get(t, 0), e) for t, e in expected.items() if e >= 5]
    rare = [t for t, e in expected.items() if e < 5]
    if rare:
        cells.append((sum(second.get(t, 0) for t in rare), sum(expected[t] for t in rare)))
    chi2 = sum((seen - e) ** 2 / e for seen, e in cells)
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[len(cells) - 1]  # p = 0.001
    assert len(cells) > 1 and chi2 < critical, (chi2, second, top)


def test_structured_output_stays_valid(plain, spec):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompt = plain.tokenizer.apply_chat_template([{"role": "user", "content":
                                                   "Alice is 30. Give her as JSON with name and age."}])
    params = {"temperature": 0, "max_new_tokens": 40, "json_schema": schema}
    want, got = plain.generate(prompt, params), spec.generate(prompt, params)
    assert got["text"] == want["text"] and set(json.loads(got["text"])) == {"name", "age"}


def test_abort_mid_verification_frees_everything(spec, prompts):
    stream = spec.generate(input_ids=prompts[0], stream=True, sampling_params={
        "temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    info = wait_idle(spec)
    assert info["kv_blocks_used"] == 0


def test_options_config_and_counters(spec):
    info = spec.get_server_info()
    assert info["speculative_config"] == SPEC
    counts = info["stats"]["spec_decode"]
    assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] >= counts["num_accepted_tokens"] > 0
    assert sum(counts["accepted_per_pos"]) == counts["num_accepted_tokens"]
    assert counts["accepted_per_pos"] == sorted(counts["accepted_per_pos"], reverse=True)
    text = render_metrics([server_info(spec)]).decode()
    assert f"unison:spec_decode_num_accepted_tokens_total {float(counts['num_accepted_tokens'])}" in text
    assert 'unison:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


def server_info(engine: Engine) -> ServerInfo:
    return engine._control(GetServerInfo())


def test_config_spellings_and_errors():
    given = EngineConfig.from_kwargs(speculative_config=json.dumps(SPEC))
    assert given.speculative_config == SpeculativeConfig(**SPEC)
    sglang = EngineConfig.from_kwargs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3,
                                      speculative_ngram_max_match_window_size=6)
    assert sglang.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=6)
    for bad, field in (({"method": "eagle"}, "method"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                       ({"draft_model": "x"}, "draft_model")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig.from_kwargs(speculative_algorithm="SUFFIX")
    # Qwen3.5's and Qwen3-Next's own draft head, in vLLM's and SGLang's spellings: refused by name
    for spelled in ({"speculative_config": {"method": "mtp"}},
                    {"speculative_config": {"method": "qwen3_next_mtp"}},
                    {"speculative_algorithm": "NEXTN"}, {"speculative_algorithm": "EAGLE"}):
        with pytest.raises(ValueError, match=r"\(MTP\) head is not run"):
            EngineConfig.from_kwargs(**spelled)


def test_propose_takes_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], k=2, n_max=3, n_min=2) == [7, 8]
    assert propose([5, 1, 2, 6, 4, 1, 2], k=3, n_max=4, n_min=2) == [6, 4, 1]
    assert propose([1, 2, 3, 4], k=3, n_max=3, n_min=2) == []  # no earlier match
    assert propose([4, 4, 4, 4], k=3, n_max=2, n_min=1) == [4]  # the match right before the end


def test_draft_length_follows_acceptance():
    """A request's next draft is one past what its last one kept, one longer after a draft kept
    whole (up to k); two misses in a row pause its drafts."""
    drafter = Drafter(SpeculativeConfig(**SPEC))  # k = 5
    req = SimpleNamespace(token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 1, 2], drafts_resume_at=0, draft_length=0,
                          draft_misses=0)
    assert drafter.drafts([req], [10], 1, 0) == [[3, 4, 5, 6, 7]]
    drafter.verified(req, [3, 4, 5, 6, 7], 1, 0)  # one kept
    assert drafter.drafts([req], [10], 1, 1) == [[3, 4]]
    drafter.verified(req, [3, 4], 2, 1)  # kept whole
    assert drafter.drafts([req], [10], 1, 2) == [[3, 4, 5, 6]]
    drafter.verified(req, [3, 4, 5, 6], 0, 2)
    assert drafter.drafts([req], [10], 1, 3) == [[3]]
    drafter.verified(req, [3], 0, 3)  # the second miss in a row
    assert drafter.drafts([req], [10], 1, 4) == [[]]
