"""Reasoning output: a thinking model's `<think>…</think>` section returned apart from its answer,
as `reasoning_content` (vLLM's, SGLang's and llama.cpp's --reasoning-parser).

- `deepseek_r1` (alias `deepseek-r1`, and `qwq`): DeepSeek-R1 and its distills, QwQ. Their chat
  templates open the section in the prompt, so the output starts inside it (a leading `<think>`
  is dropped); everything up to `</think>` is reasoning, and all of it is when no `</think>`
  comes (cut short while thinking).
- `qwen3`: the output is in the section when it starts with `<think>`, or when the prompt ends
  with an open `<think>` (templates that start thinking themselves); otherwise all of it is the
  answer, as with `enable_thinking: false`, whose template writes an empty section into the
  prompt.

The split is one state machine fed text in pieces: a tag split across pieces is held back until
it is decided, so the streamed pieces join to exactly the whole-text result. Whitespace right
after `</think>` is dropped (the templates put a blank line there).
"""

from __future__ import annotations

from dataclasses import dataclass

from unison.config import REASONING_PARSERS

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


def starts_in_reasoning(parser: str, prompt: str) -> bool:
    """Whether the output begins inside the reasoning section, given the rendered prompt."""
    return REASONING_PARSERS[parser] == "deepseek_r1" or prompt.rstrip().endswith(START)


class ReasoningSplitter:
    """Feed the output text as it grows; each call returns what is now decided."""

    def __init__(self, parser: str, prompt: str = "") -> None:
        # "open": before the first character (a <think> may come); "in": reasoning; "after": the
        # answer's leading whitespace is being dropped; "out": the answer.
        self.inside_first = starts_in_reasoning(parser, prompt)
        self.state = "open"
        self.held = ""

    def feed(self, text: str) -> Split:
        self.held += text
        out = Split()
        while True:
            step = self._step()
            if step is None:
                return out
            out = out + step

    def finish(self) -> Split:
        """The end of the output: what was held back is what it is."""
        held, self.held = self.held, ""
        if self.state == "in" or (self.state == "open" and self.inside_first):
            return Split(reasoning=held.removeprefix(START) if self.state == "open" else held)
        if self.state == "after":
            return Split()
        return Split(content=held)

    def _step(self) -> Split | None:
        """One decision on the held text, or None when it needs more."""
        held = self.held
        if self.state == "open":
            lead = held.lstrip()
            if START.startswith(lead) and len(lead) < len(START):
                return None  # nothing but whitespace and maybe a <think> begun
            if lead.startswith(START):
                self.held, self.state = lead[len(START):], "in"
            else:
                self.state = "in" if self.inside_first else "out"
            return Split()
        if self.state == "in":
            at = held.find(END)
            if at >= 0:
                self.held, self.state = held[at + len(END):], "after"
                return Split(reasoning=held[:at])
            keep = _partial_suffix(held, END)
            self.held = held[len(held) - keep:]
            return Split(reasoning=held[: len(held) - keep]) if len(held) > keep else None
        if self.state == "after":
            rest = held.lstrip()
            if not rest:
                self.held = ""
                return None
            self.held, self.state = rest, "out"
            return Split()
        if not held:
            return None
        self.held = ""
        return Split(content=held)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_whole(parser: str, prompt: str, text: str) -> Split:
    splitter = ReasoningSplitter(parser, prompt)
    return splitter.feed(text) + splitter.finish()
