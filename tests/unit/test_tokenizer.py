"""Tokenizer and chat template against transformers, the reference they must match exactly."""

from __future__ import annotations

import json
import shutil

import pytest

from unison.frontend.text.tokenizer import Tokenizer

STRINGS = [
    "",
    "Hello, world!",
    " leading space and  double  spaces",
    "tabs\tand\nnewlines\n\n\n  indented",
    "👋🏽 café 日本語 ✓",
    "emoji run 🎉🎉🎉 and flags 🇫🇷",
    "digits 1234567890 3.14159 -42 1e-9",
    "中文和日本語と한국어",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <|im_end|>",
    "   \n\t  ",
    "def f(x):\n    return x ** 2  # comment\n",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 👋"},
    ],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "  spaces\nand lines  "},
    ],
]

# Exercises the globals and filters transformers adds to the sandbox.
CUSTOM_TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "{{ bos_token }}{{ m['role'] }}: {{ m['content'] | tojson }}\n"
    "{% if ns.n > 5 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{{ dict(a=1) | tojson }} {{ eos_token }}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", STRINGS)
def test_encode_matches_transformers(tok, hf, text):
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text)


@pytest.mark.parametrize("text", STRINGS)
def test_decode_matches_transformers(tok, hf, text):
    ids = hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == ref


def test_custom_template_matches_transformers(tok, hf):
    messages = CHATS[3] + [{"role": "tool", "content": '<b>"quoted" é</b>'}]
    ours = tok.apply_chat_template(messages, chat_template=CUSTOM_TEMPLATE)
    ref = hf.apply_chat_template(
        messages, chat_template=CUSTOM_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert ours == ref


def test_continue_final_message_matches_transformers(tok, hf):
    messages = CHATS[0] + [{"role": "assistant", "content": "The answer begins"}]
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    ref = hf.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                 tokenize=False)
    assert ours == ref and ours.endswith("The answer begins")
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_kwargs_reach_the_template(tok, hf):
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"
    for thinking in (True, False):
        ours = tok.apply_chat_template(CHATS[0], chat_template=template, enable_thinking=thinking)
        ref = hf.apply_chat_template(CHATS[0], chat_template=template, enable_thinking=thinking,
                                     tokenize=False)
        assert ours == ref and ours.startswith("<think>") == thinking


def test_template_raise_exception_and_sandbox(tok):
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="nope"):
        tok.apply_chat_template(CHATS[0], chat_template="{{ raise_exception('nope') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(CHATS[0], chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(
            CHATS[0], chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}"
        )


def test_content_parts_are_joined(tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    joined = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert joined == tok.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]: role must be one of"),
        ([{"role": "robot", "content": "hi"}], "got 'robot'"),
        ([{"role": "user"}], r"messages\[0\]: content must be a string"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"content\[0\]: only"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"content\[0\]: only"),
    ],
)
def test_message_validation(tok, messages, error):
    with pytest.raises(ValueError, match=error):
        tok.apply_chat_template(messages)


def test_assistant_tool_call_without_content(tok):
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    template = "{{ messages[1].tool_calls | tojson }}"
    assert tok.apply_chat_template(messages, chat_template=template) == json.dumps(calls)


def test_special_tokens(tok, hf):
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert hf.eos_token_id in tok.eos_token_ids
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.vocab_size >= len(hf)


def test_from_dir_merges_configs(tmp_path, model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50000}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == {0, 2, 7}
    assert tok.vocab_size == 50000
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(CHATS[0]) == "DWhat is the capital of France?"
    assert tok.apply_chat_template(CHATS[0], tools=[{"name": "f"}]) == "T1"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_a_text_past_the_limit_is_refused_from_a_prefix(tok):
    """A huge text is refused after tokenizing a prefix: milliseconds, not the seconds its whole
    would take; the error names the field and the context length."""
    import time

    from unison.errors import InvalidParam

    huge = "a " * 5_000_000  # 10 MB: about 5 M tokens
    t0 = time.perf_counter()
    with pytest.raises(InvalidParam) as e:
        tok.encode(huge, limit=8192, field="messages")
    assert time.perf_counter() - t0 < 1.0  # the whole text takes seconds
    assert e.value.field == "messages" and "exceeds the context length (8192)" in str(e.value)


@pytest.mark.parametrize("text", [
    "word " * 2040,  # just within 2048 tokens, longer than the first prefix (4 chars a token)
    "=" * 60_000,  # few tokens for many characters: the prefixes grow past it, nothing refused
    "日本語 " * 200,
])
def test_a_text_within_the_limit_is_tokenized_whole(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) <= 2048
    assert tok.encode(text, add_special_tokens=False, limit=2048) == ids


def test_a_text_its_prefixes_do_not_prove_too_long_comes_back_whole(tok):
    """Past the limit, but at more characters a token than the prefixes assume: the whole text is
    tokenized and returned, and the caller's check counts it (as for token ids given)."""
    text = "word " * 3000  # 5 characters a token: no prefix shorter than the text holds 2048
    assert len(tok.encode(text, limit=2048)) == len(tok.encode(text)) > 2048
