"""The harmony format's pieces in-process: o200k_base written offline from a model's tokenizer,
prompts, the output parser token by token, and the grammar of a forced call."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.models import harmony_dir
from unison.errors import InvalidParam
from unison.frontend.text import harmony
from unison.frontend.text.harmony import HarmonyStream, Parsed, render_prompt
from unison.frontend.text.structured import grammar_text
from unison.frontend.text.tokenizer import Tokenizer, normalize_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(harmony_dir())


@pytest.fixture(scope="module")
def encoding(tokenizer):
    assert tokenizer.harmony is not None
    return tokenizer.harmony


def ids(encoding, text: str) -> list[int]:
    return encoding.encode(text, allowed_special="all")


def test_o200k_base_is_written_from_the_models_own_tokenizer(tokenizer, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    vocab = tokenizer._tok.get_vocab(with_added_tokens=False)
    folder = harmony._o200k_folder(vocab)
    assert folder == tmp_path / ".cache" / "unison" / "tiktoken"
    written = (folder / "o200k_base.tiktoken").read_bytes()
    assert hashlib.sha256(written).hexdigest() == harmony.O200K_SHA256  # the file openai-harmony pins
    first = next(k for k, v in vocab.items() if v == 0)
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="TIKTOKEN_ENCODINGS_BASE"):
        harmony._o200k_folder({**vocab, first: 1, "x": 0})  # another vocabulary: refused, not guessed
    assert Tokenizer.from_dir(model_dir).harmony is None  # SmolLM2 does not speak harmony


def test_answered_turns_lose_their_analysis_and_a_calling_turn_keeps_it(encoding):
    call = {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning": "r1", "content": "x"},
            {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
            {"role": "assistant", "reasoning_content": "r2", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = encoding.decode(render_prompt(encoding, normalize_messages(msgs), [WEATHER], "low"))
    assert "r1" not in text and "r2" in text and "Reasoning: low" in text
    assert "<|start|>user<|message|>b\nc<|end|>" in text  # text parts joined as for chat templates
    assert '<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>' in text  # dict arguments: JSON
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny" in text
    assert text.endswith("<|start|>assistant")
    done = encoding.decode(render_prompt(encoding, normalize_messages(msgs[:2]), None, None,
                                         add_generation_prompt=False))
    assert done.endswith("<|channel|>final<|message|>x<|end|>") and "# Tools" not in done


@pytest.mark.parametrize("message, field", [
    ({"role": "tool", "tool_call_id": "zz", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "critic", "content": "x"}, "messages[0]"),  # (normalize_messages' name for it)
    ({"role": "user", "content": [{"type": "image_url"}]}, "messages[0].content[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {}}]}, "messages[0].tool_calls[0]")])
def test_bad_messages_are_refused_naming_the_field(encoding, message, field):
    with pytest.raises(InvalidParam) as e:
        render_prompt(encoding, normalize_messages([message]), None, None)
    assert e.value.field == field


def test_builtin_tool_names_are_refused():
    with pytest.raises(InvalidParam, match="built-in browser"):
        harmony.check_tools([WEATHER, {"type": "function", "function": {"name": "browser"}}])
    harmony.check_tools([WEATHER])


def feed_one_by_one(stream: HarmonyStream, tokens: list[int]) -> Parsed:
    out = Parsed()
    for i, t in enumerate(tokens):
        p = stream.feed([t], finished=i == len(tokens) - 1)
        assert not (p.content and p.reasoning), p  # a token belongs to one channel
        out.content, out.reasoning = out.content + p.content, out.reasoning + p.reasoning
        out.tool_calls += p.tool_calls
    return out


REPLIES = {  # reply -> (content, reasoning, [(name, arguments)])
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>":
        ("Hi!", "Think.", []),
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
    '<|channel|>commentary <|constrain|>json<|message|>{"city": "Oslo"}<|call|>':
        ("Checking.", "", [("get_weather", '{"city": "Oslo"}')]),
    "<|channel|>commentary to=functions.get_weather<|message|>{oops<|call|>": ("{oops", "", []),
    "<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|chan": ("assistant<|chan", "Hmm", []),
    "<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant to=functions.get_weather<|channel|>"
    'commentary json<|message|>{"ci': ('{"ci', "Hmm", []),
    "Plain words, no format.": ("Plain words, no format.", "", []),
}


@pytest.mark.parametrize("reply", REPLIES)
def test_a_reply_streamed_token_by_token_equals_it_whole(encoding, reply):
    content, reasoning, calls = REPLIES[reply]
    tokens = ids(encoding, reply)
    whole = HarmonyStream(encoding).feed(tokens, finished=True)
    streamed = feed_one_by_one(HarmonyStream(encoding), tokens)
    for parsed in (whole, streamed):
        assert (parsed.content, parsed.reasoning) == (content, reasoning)
        named = [(d.name, d.arguments) for d in parsed.tool_calls if d.name]
        assert named == [(name, "") for name, _ in calls]
        assert [d.arguments for d in parsed.tool_calls if not d.name] == [a for _, a in calls]


def test_calls_are_content_when_not_allowed(encoding):
    tokens = ids(encoding, '<|channel|>commentary to=functions.get_weather<|message|>{"a": 1}<|call|>')
    parsed = HarmonyStream(encoding, calls_allowed=False).feed(tokens, finished=True)
    assert (parsed.content, parsed.tool_calls) == ('{"a": 1}', [])


def test_the_forced_call_grammar_compiles_and_names_each_function():
    schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
               "get_time": {"type": "object"}}
    text = harmony.call_grammar(schemas)
    assert '" to=functions.get_weather"' in text and '" to=functions.get_time"' in text
    assert json.loads(text.split("%json", 2)[1].split(" | ")[0])["additionalProperties"] is False
    assert grammar_text(ebnf=text)  # llguidance accepts it


def test_the_tiny_models_tokenizer_is_gpt_oss_s(tokenizer):
    assert Path(harmony_dir()).name.startswith("tiny-harmony")
    assert all(tokenizer.token_id(t) == i for t, i in harmony.MARKERS.items())
    assert tokenizer.vocab_size == 201_088
