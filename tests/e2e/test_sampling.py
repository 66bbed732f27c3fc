"""The sampling schema (unison/sampling.py): every option reaches each place derived from it, is
checked by name in the frontend and again in the core, and does what its reference does."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from tests.utils import hf_model
from unison import Engine, SamplingParams
from unison.core.sampler import _typical
from unison.errors import InvalidParam
from unison.sampling import CORE_OPTIONS, OPTIONS, CoreSamplingParams, Option, core_problem
from unison.server.apis.openai.bodies import ChatCompletionRequest, CompletionRequest

VOCAB = 1000
# A value each option may take that differs from its default.
OTHER = {int: 3, float: 0.5, bool: True, str: "x", list: [7], dict: {"7": 1.0}}


def other_value(o: Option):
    for kind, value in OTHER.items():
        if o.type is kind or kind in getattr(o.type, "__args__", ()) or \
                any(getattr(a, "__origin__", None) is kind for a in getattr(o.type, "__args__", ())):
            return value
    raise AssertionError(f"no sample value for {o.name}: {o.type}")


def out_of_range(o: Option):
    return (o.lo - 1 if not o.lo_open else o.lo) if o.lo is not None else o.hi + 1


def test_every_option_is_a_field_of_each_derived_place():
    user, core = typing.get_type_hints(SamplingParams), typing.get_type_hints(CoreSamplingParams)
    assert list(user) == [o.name for o in OPTIONS]
    assert list(core)[-len(CORE_OPTIONS):] == [o.name for o in CORE_OPTIONS]  # after the derived ones
    for o in OPTIONS:
        assert user[o.name] == o.type, o.name
        if o.core:
            assert core[o.name] == o.type, o.name
        assert getattr(SamplingParams(), o.name) == o.default, o.name
        if o.core:
            assert getattr(CoreSamplingParams(), o.name) == o.default, o.name
        for body in (CompletionRequest, ChatCompletionRequest):
            assert (o.openai in body.model_fields) == (o.openai is not None), (body.__name__, o.name)
            if o.openai is not None:
                assert body.model_fields[o.openai].annotation == o.type | None, o.name


@pytest.mark.parametrize("o", [o for o in OPTIONS if o.openai and o.name not in ("max_new_tokens",)],
                         ids=lambda o: o.name)
def test_an_openai_field_arrives_as_its_option(o: Option):
    value = other_value(o)
    body = CompletionRequest(prompt="x", **{o.openai: value})
    params = body.sampling_params(16)
    assert getattr(params, o.name) == value
    if o.core and o.numeric:
        core = SamplingParams(**{o.name: value}).to_core(VOCAB, 16)
        assert getattr(core, o.name) == value


def test_unset_openai_fields_take_the_model_defaults_and_null_is_unset():
    defaults = {"temperature": 0.3, "typical_p": 0.9, "max_new_tokens": 5}
    params = CompletionRequest(prompt="x", top_p=None, temperature=0.7).sampling_params(16, defaults)
    assert (params.temperature, params.typical_p, params.top_p, params.max_new_tokens) == (0.7, 0.9, 1.0, 5)


@pytest.mark.parametrize("o", [o for o in OPTIONS if o.numeric], ids=lambda o: o.name)
def test_out_of_range_is_refused_by_name_in_the_frontend_and_the_core(o: Option):
    bad = out_of_range(o)
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**{o.name: bad}).validate(vocab_size=VOCAB, context_length=4096, prompt_len=4)
    assert e.value.field == o.name and o.range_text() in str(e.value)
    if o.core:
        assert core_problem(CoreSamplingParams(**{o.name: bad})) == f"{o.name} {o.problem(bad)}"
    if o.core and o.type is float:
        assert core_problem(CoreSamplingParams(**{o.name: math.nan})) == \
            f"{o.name} must be in {o.range_text()}, got nan"


def test_wrong_types_are_refused_by_name():
    for name, value in (("typical_p", "high"), ("top_k", 1.5), ("ignore_eos", 1), ("n", True)):
        with pytest.raises(InvalidParam) as e:
            SamplingParams(**{name: value}).validate(vocab_size=VOCAB, context_length=4096, prompt_len=4)
        assert e.value.field == name, (name, str(e.value))


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_keeps_what_transformers_keeps(mass: float):
    from transformers.generation.logits_process import TypicalLogitsWarper

    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(int(mass * 100))) * 3
    theirs = TypicalLogitsWarper(mass=mass)(torch.zeros(8, 1, dtype=torch.long), logits.clone())
    ours = _typical(torch.softmax(logits, -1), torch.full((8,), mass))
    assert torch.equal(ours > 0, theirs > -math.inf)
    whole = _typical(torch.softmax(logits, -1), torch.ones(8))
    assert torch.equal(whole, torch.softmax(logits, -1))  # mass 1 leaves a row as it was


@pytest.fixture(scope="module")
def engine():
    with Engine(quantization="none", max_running_requests=4) as e:
        yield e


def test_typical_p_end_to_end_equals_transformers(engine):
    """With a tiny mass only the single most typical token survives a step, so sampling is
    deterministic whatever the seed, and must follow transformers' warper step by step."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    prompt = engine.tokenizer.encode("The best way to learn a language is")
    params = {"typical_p": 1e-6, "temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    outs = [engine.generate(input_ids=prompt, sampling_params=params | {"sampling_seed": s})["output_ids"]
            for s in (1, 2)]
    assert outs[0] == outs[1]
    ids, warp = list(prompt), TypicalLogitsWarper(mass=1e-6)
    with torch.inference_mode():
        for _ in range(12):
            logits = hf_model()(torch.tensor([ids])).logits[:, -1].float()
            ids.append(int(warp(torch.tensor([ids]), logits).argmax()))
    assert outs[0] == ids[len(prompt):]
    with pytest.raises(ValueError, match=r"typical_p must be in \(0.0, 1.0\]"):
        engine.generate(input_ids=prompt, sampling_params={"typical_p": 0})
