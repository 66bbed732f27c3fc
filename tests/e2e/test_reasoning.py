"""Reasoning output: the <think> section apart from the answer (--reasoning-parser), split exactly
whatever the streaming pieces, and structured output that starts after the section."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.serving import Server, serve
from tests.utils import HTTP
from unison import Engine
from unison.frontend.text.reasoning import ReasoningSplitter, Split, split_whole

MODEL = "SmolLM2-135M-Instruct"  # the served name of the embedded model

# (parser, the prompt's end, the output, the reasoning, the answer): as models write them.
RECORDED = [
    ("deepseek_r1", "<|Assistant|><think>\n",
     "Okay, 2 + 2: add them.\nThat is 4.\n</think>\n\nThe answer is **4**.",
     "Okay, 2 + 2: add them.\nThat is 4.\n", "The answer is **4**."),
    ("deepseek_r1", "<|Assistant|>", "<think>\nHmm, the capital of France.</think>Paris.",
     "\nHmm, the capital of France.", "Paris."),
    ("deepseek_r1", "<|Assistant|><think>\n", "Still thinking when max_tokens cut it: <th",
     "Still thinking when max_tokens cut it: <th", ""),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "\nThe user greets me.\n", "Hello! How can I help?"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "No thinking: enable_thinking was false.",
     "", "No thinking: enable_thinking was false."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Opened by the template.</think>Answer <b>bold</b> </thin",
     "Opened by the template.", "Answer <b>bold</b> </thin"),
    ("qwen3", "<|im_start|>assistant\n", "  <thinking> is not the tag", "", "  <thinking> is not the tag"),
    ("qwen3", "<|im_start|>assistant\n", "<think>a < b and b </ c</think>", "a < b and b </ c", ""),
    ("qwq", "<|im_start|>assistant\n<think>\n", "x</think>\n \n y", "x", "y"),
]


@pytest.mark.parametrize("parser, prompt, text, reasoning, content", RECORDED)
def test_recorded_texts_split_exactly_at_every_position(parser, prompt, text, reasoning, content):
    assert split_whole(parser, prompt, text) == Split(reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):  # two and three pieces
            splitter = ReasoningSplitter(parser, prompt)
            got = splitter.feed(text[:i]) + splitter.feed(text[i:j]) + splitter.feed(text[j:])
            got = got + splitter.finish()
            assert got == Split(reasoning, content), (i, j)


def test_token_by_token_deltas_never_hold_back_more_than_a_tag():
    """Streamed reasoning arrives as it is written: at most a possible '</think>' is held back."""
    text = "<think>" + "word " * 20 + "</think>answer"
    splitter, sent = ReasoningSplitter("qwen3"), Split()
    for k, ch in enumerate(text):
        sent = sent + splitter.feed(ch)
        seen = text[: k + 1]
        if seen.startswith("<think>") and "</think>" not in seen:
            assert len(seen) - len("<think>") - len(sent.reasoning) < len("</think>")
    assert (sent + splitter.finish()) == Split("word " * 20, "answer")


# As Qwen3's: thinking opened in the prompt, or an empty section written there with
# enable_thinking false.
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                     "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    yield from serve("reasoning parser", "--reasoning-parser", "qwen3", "--chat-template", str(template))


def _chat(server: Server, **body) -> httpx.Response:
    return server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 2 + 2?"}],
                                                "max_tokens": 16, "temperature": 0, **body})


def test_a_template_that_opens_thinking_gives_reasoning_content(thinking_server: Server):
    """The prompt ends inside <think>: what the model writes is reasoning until it closes it (the
    embedded model never does in 16 tokens), streamed as reasoning_content deltas that join to
    the whole."""
    whole = _chat(thinking_server).json()["choices"][0]["message"]
    assert whole["reasoning_content"] and whole["content"] in (None, "")
    with HTTP.stream("POST", thinking_server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 16,
                            "temperature": 0, "stream": True}) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == whole["reasoning_content"]
    assert not any(d.get("content") for d in deltas)


def test_anthropic_and_ollama_answers_carry_the_reasoning_apart(thinking_server: Server):
    """The same reasoning as the chat route's: a thinking block (Anthropic's, whole and as
    thinking_delta events) and Ollama's message.thinking."""
    ask = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "temperature": 0}
    reasoning = _chat(thinking_server).json()["choices"][0]["message"]["reasoning_content"]
    message = thinking_server.post("/v1/messages", {**ask, "max_tokens": 16}).json()
    assert message["content"][0] == {"type": "thinking", "thinking": reasoning, "signature": ""}
    with HTTP.stream("POST", thinking_server.url + "/v1/messages", timeout=60,
                      json={**ask, "max_tokens": 16, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[1]["content_block"]["type"] == "thinking"
    assert "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta") == reasoning
    chat = thinking_server.post("/api/chat", {"messages": ask["messages"], "model": MODEL, "stream": False,
                                              "options": {"num_predict": 16, "temperature": 0}}).json()
    assert chat["message"]["thinking"] == reasoning and chat["message"]["content"] == ""


def test_structured_output_starts_after_the_reasoning_section(thinking_server: Server):
    """With a parser, a response_format holds the answer, not the reasoning: the model is free
    until '</think>', which it does not write here, so nothing of it was forced into JSON."""
    r = _chat(thinking_server, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}})
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and not message["reasoning_content"].lstrip().startswith("{")


def test_enable_thinking_false_gives_plain_content(thinking_server: Server):
    r = _chat(thinking_server, chat_template_kwargs={"enable_thinking": False})
    message = r.json()["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"] is None


def test_without_a_closing_tag_in_the_prompt_nothing_changes(thinking_server: Server):
    """continue_final_message after a closed section: the answer is content, no reasoning."""
    turns = [{"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "<think>Easy.</think>The capital is"}]
    r = _chat(thinking_server, messages=turns, add_generation_prompt=False, continue_final_message=True)
    message = r.json()["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"] is None


def test_structured_after_frees_the_output_until_its_tokens():
    """The core's half: the regex holds only what follows the given token ids."""
    with Engine(max_total_tokens=2048) as engine:
        after = engine.tokenizer.encode(" the", add_special_tokens=False)
        assert len(after) == 1
        out = engine.generate("Once upon a time, in the land of", {
            "max_new_tokens": 24, "temperature": 0, "regex": r"[0-9]{1,6}", "structured_after": after})
        ids = out["output_ids"]
        assert after[0] in ids, out["text"]
        rest = engine.tokenizer.decode(ids[ids.index(after[0]) + 1:])
        assert re.fullmatch(r"[0-9]{1,6}", rest), out["text"]
        with pytest.raises(ValueError, match="structured_after needs json_schema"):
            engine.generate("x", {"structured_after": after})
