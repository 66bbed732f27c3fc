"""Incremental detokenizing with stop strings: one IncrementalDetokenizer per request.

Decoding is tokenizers' DecodeStream (one native call per token, as vLLM's fast path): it emits
the text a token adds after the tokens before it (which give it its context, e.g. a SentencePiece
leading space), and nothing while the text ends inside a UTF-8 character. Under a decoder that
works token by token (byte-level BPE: Llama 3, Qwen, SmolLM; Gemma's), a token of whole
characters after whole text adds its own text, which is looked up instead (Tokenizer.whole_text).
Stop strings are searched in the new text plus the last `max_stop_len - 1` characters, and the
longest tail that could still begin a stop string is held back, so no delta ever shows text that a
later stop trims. Every step costs O(max_stop_len), never O(length of the output).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# Prompt tokens decoded with the first output tokens, so the first one gets its context.
PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    whole_texts: dict[int, str | None] | None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def whole_text(self, token: int) -> str | None: ...

    def decode_stream(self, skip_special_tokens: bool, context: list[int]) -> Callable[[int], str | None]: ...


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas, and finds its stop strings.

    `text` is the sum of the deltas returned so far; `output_ids` the request's tokens, ending
    at the token that completed a stop string. With `prompt_ids`, the first output tokens are
    decoded after the prompt's last tokens, as vLLM does. `spaces_between_special_tokens` is
    accepted for API parity: like HF fast tokenizers (hence vLLM and SGLang), it has no effect.
    """

    __slots__ = (
        "_tok", "_skip", "_stops", "_max_stop", "_no_stop_trim", "_ctx", "_stream", "_whole",
        "_pending", "_prev_prefix", "_prefix", "_read", "_recent", "_held", "_chunks", "output_ids",
        "stop_matched", "finished",
    )  # fmt: skip

    def __init__(
        self,
        tokenizer: _Decoder,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        prompt_ids: list[int] | None = None,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._stops = tuple(dict.fromkeys(stop))
        self._max_stop = max(map(len, self._stops), default=0)
        self._no_stop_trim = no_stop_trim
        # Offsets index output_ids; negative ones reach back into the prompt's context tokens.
        self._ctx = self._context(prompt_ids or [])
        self._stream = tokenizer.decode_stream(skip_special_tokens, self._ctx)
        self._whole = tokenizer.whole_texts  # (shared by the tokenizer's requests; None: unused)
        self._pending = False  # the stream holds tokens of an incomplete character (or skipped)
        self._prev_prefix = self._prefix = -len(self._ctx)
        self._read = 0
        self.output_ids: list[int] = []
        self._recent = self._held = ""  # last emitted chars / confirmed chars not yet emitted
        self._chunks: list[str] = []
        self.stop_matched: str | None = None
        self.finished = False

    def _context(self, prompt_ids: list[int]) -> list[int]:
        ctx = list(prompt_ids[-PROMPT_CONTEXT:])
        # A prompt that ends inside a character would shift the first delta: decode without it.
        return [] if self._decode(ctx).endswith(REPLACEMENT) else ctx

    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text they confirm. Tokens after a stop string are dropped."""
        if not self._stops:  # the common case, once per token per request: kept to the bone
            return self._add_plain(new_ids)
        out = []
        for token in new_ids:
            if self.finished:
                break
            self.output_ids.append(token)
            if delta := self._step():
                out.append(self._push(delta, final=False))
        return "".join(out)

    def _add_plain(self, new_ids: Sequence[int]) -> str:
        if self.finished:
            return ""
        ids, text_of, out = self.output_ids, self._text_of, []
        for token in new_ids:
            ids.append(token)
            text = text_of(token)
            if text is not None:
                self._prev_prefix, self._prefix, self._read = self._prefix, self._read, len(ids)
                out.append(text)
        text = out[0] if len(out) == 1 else "".join(out)
        if text:
            self._chunks.append(text)
        return text

    def flush(self) -> str:
        """End the request: release held-back text and any incomplete character (as U+FFFD)."""
        if self.finished:
            return ""
        delta = self._push(self._final_step(), final=True)
        self.finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _slice(self, start: int, end: int | None = None) -> list[int]:
        if start >= 0:
            return self.output_ids[start:end]
        return self._ctx[len(self._ctx) + start :] + self.output_ids[:end]

    def _text_of(self, token: int) -> str | None:
        """The text `token` adds after the tokens before it; None while a character is incomplete.
        After whole characters, a token of whole characters adds its own text: looked up, no
        stream call. (The stream, behind by such tokens, still decodes the rest right: their text
        does not depend on what came before them.)"""
        whole = self._whole
        if whole is not None and not self._pending:
            text = whole[token] if token in whole else self._tok.whole_text(token)
            if text is not None:
                return text
        text = self._stream(token)
        self._pending = text is None
        return text

    def _step(self) -> str:
        """The text the newest token completes ("" while a character is incomplete)."""
        text = self._text_of(self.output_ids[-1])
        if text is None:
            return ""
        # The delta spans output_ids[_prefix:_read]; _prev_prefix starts the one before it,
        # which gives _truncate_ids its context.
        self._prev_prefix, self._prefix, self._read = self._prefix, self._read, len(self.output_ids)
        return text

    def _final_step(self) -> str:
        """At the end: whatever the tokens after the last delta hold, an incomplete character as
        U+FFFD (decoded as a window, since the stream only ever returns whole characters)."""
        if self._read == len(self.output_ids):
            return ""
        prefix = self._prefix
        prefix_text = self._decode(self._slice(prefix, self._read))
        new_text = self._decode(self._slice(prefix))
        self._prev_prefix, self._prefix, self._read = prefix, self._read, len(self.output_ids)
        return new_text[len(prefix_text) :]

    def _push(self, delta: str, final: bool) -> str:
        """Check confirmed `delta` for stop strings; return the part that may be shown now."""
        if not self._stops:
            self._chunks.append(delta)
            return delta
        pending = self._held + delta
        buf = self._recent + pending
        if match := self._find_stop(buf):
            start, stop = match
            self.stop_matched, self.finished = stop, True
            end = start + len(stop)
            self._truncate_ids(end - (len(buf) - len(delta)))
            emit = pending[: (end if self._no_stop_trim else start) - len(self._recent)]
            self._held = ""
        else:
            keep = len(pending) - (0 if final else self._stop_prefix_len(buf))
            emit, self._held = pending[:keep], pending[keep:]
        self._recent = (self._recent + emit)[-(self._max_stop - 1) :] if self._max_stop > 1 else ""
        self._chunks.append(emit)
        return emit

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        # The stop string that ends first wins (the longer one on a tie): what token-by-token
        # streaming would see, however the tokens are batched.
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            if (i := buf.find(s)) >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            if len(s) < 2:
                continue
            tail = buf[-(len(s) - 1) :]
            i = tail.find(s[0])
            while i != -1 and len(tail) - i > best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best

    def _truncate_ids(self, need: int) -> None:
        """Drop tokens after the one that completed `need` characters of the last delta.

        A delta may span several tokens when it waited for a character to complete: find the
        first of them whose text (less an incomplete last character) reaches the stop's end.
        """
        start, first, last = self._prev_prefix, self._prefix, self._read
        if last - first > 1:
            base = len(self._decode(self._slice(start, first)))
            for j in range(first + 1, last):
                if len(self._decode(self._slice(start, j)).rstrip(REPLACEMENT)) - base >= need:
                    last = j
                    break
        del self.output_ids[last:]


class TokenIds:
    """The detokenizer of an engine without a tokenizer (skip_tokenizer_init): ids only."""

    __slots__ = ("output_ids", "finished", "stop_matched")

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.finished = False
        self.stop_matched: str | None = None

    def add(self, new_ids: Sequence[int]) -> str:
        if not self.finished:
            self.output_ids.extend(new_ids)
        return ""

    def flush(self) -> str:
        self.finished = True
        return ""


CONTEXT = 16  # characters before a stop_regex window, for anchors and lookbehinds


class StopRegex:
    """SGLang's stop_regex: patterns searched in the output text as it grows. Each search looks
    at the new text and as much of the text before it as a match can span (the whole text only
    for a pattern of unbounded width), so a step costs O(the longest match), not O(the output)."""

    UNBOUNDED = 1 << 16  # wider than this: search the whole text

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = [re.compile(p) for p in patterns]
        self.lookback = max(_max_width(p) for p in self.patterns)
        self.matched: str | None = None  # the pattern that matched (SGLang reports the pattern)

    def search(self, before: str, delta: str) -> int | None:
        """Where in `delta` the earliest-ending match that ends in it ends, or None. Matches
        start in the window, which keeps CONTEXT characters more before it: anchors, word
        boundaries and lookbehinds see the real text there, not a string's start."""
        whole = self.lookback >= self.UNBOUNDED or len(before) <= self.lookback + CONTEXT
        tail = before if whole else before[-(self.lookback + CONTEXT):]
        start = 0 if whole else CONTEXT  # where a match may begin
        text, best = tail + delta, None
        for p in self.patterns:
            for m in p.finditer(text, start):
                if m.end() > len(tail):
                    if best is None or m.end() < best[0]:
                        best = (m.end(), p.pattern)
                    break
        if best is None:
            return None
        self.matched = best[1]
        return best[0] - len(tail)


def _max_width(pattern: re.Pattern) -> int:
    """The most characters a match of `pattern` spans (re's own parser: no width bound in the
    public API)."""
    try:
        from re import _parser  # type: ignore[attr-defined]  # (Python 3.11+; private: typeshed has no stub)

        return min(_parser.parse(pattern.pattern, pattern.flags).getwidth()[1], StopRegex.UNBOUNDED)
    except Exception:  # a parser we cannot read: search everything
        return StopRegex.UNBOUNDED
