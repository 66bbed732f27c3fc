"""IncrementalDetokenizer: the deltas add up to the full decode, however the tokens arrive."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unison.frontend.text.detokenizer import IncrementalDetokenizer
from unison.frontend.text.tokenizer import Tokenizer

TEXTS = [
    "👋🏽 café 日本語 ✓",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "  leading spaces,\ttabs\n\nand   runs of   spaces  ",
    "Emoji 🎉🎉 flags 🇫🇷🇯🇵 and 中文字符 mixed with ascii 12345.",
    "<|im_start|>assistant\nSure! Here it is: naïve — “quoted” ✓<|im_end|>\n",
    "def f(x):\n    return x ** 2  # 平方\n",
]
FAST = settings(derandomize=True, deadline=None, max_examples=50, database=None)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def stream(tok, ids, sizes, **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` in chunks of `sizes` (cycled); return the detokenizer and every delta."""
    detok, deltas, i, k = IncrementalDetokenizer(tok, **kwargs), [], 0, 0
    while i < len(ids) and not detok.finished:
        n = sizes[k % len(sizes)] if sizes else 1
        deltas.append(detok.add(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(detok.flush())
    return detok, deltas


def reference_stop(tok, ids, stops, no_stop_trim=False, skip=True):
    """What a stop-string run must produce: text, output ids and the stop, by brute force."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if hits:
            end, start, s = min(hits)
            return text[: end if no_stop_trim else start], ids[:k], s
    return tok.decode(ids, skip_special_tokens=skip), ids, None


sizes_st = st.lists(st.integers(1, 4), min_size=1, max_size=8)


@FAST
@given(text=st.sampled_from(TEXTS), sizes=sizes_st, skip=st.booleans())
def test_deltas_add_up_to_decode(tok, text, sizes, skip):
    ids = tok.encode(text)
    detok, deltas = stream(tok, ids, sizes, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_ids == ids and detok.stop_matched is None
    assert not any("\ufffd" in d for d in deltas)


@FAST
@given(ids=st.lists(st.integers(0, 49151), max_size=40), sizes=sizes_st)
def test_random_ids_add_up_to_decode(tok, ids, sizes):
    # What a sampled model may emit: stray UTF-8 bytes, special tokens, anything.
    detok, deltas = stream(tok, ids, sizes)
    assert "".join(deltas) == tok.decode(ids)


@FAST
@given(data=st.data(), sizes=sizes_st, no_stop_trim=st.booleans())
def test_stop_strings_match_reference(tok, data, sizes, no_stop_trim):
    text = data.draw(st.sampled_from(TEXTS))
    ids = tok.encode(text)
    full = tok.decode(ids)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 12))])
    detok, deltas = stream(tok, ids, sizes, stop=stops, no_stop_trim=no_stop_trim)
    want_text, want_ids, want_stop = reference_stop(tok, ids, stops, no_stop_trim)
    assert (detok.text, detok.output_ids, detok.stop_matched) == (want_text, want_ids, want_stop)
    assert "".join(deltas) == want_text  # nothing later trimmed was ever shown


def test_stop_across_tokens(tok):
    ids = tok.encode("The capital of France is Paris.")
    assert [tok.decode([i]) for i in ids[:3]] == ["The", " capital", " of"]
    detok = IncrementalDetokenizer(tok, stop=["capital of"])
    assert detok.add(ids[:1]) == "The"
    assert detok.add(ids[1:2]) == " "  # "capital" could begin the stop string: held back
    assert detok.add(ids[2:]) == ""  # the rest of the batch is dropped
    assert detok.finished and detok.stop_matched == "capital of"
    assert detok.text == "The " and detok.output_ids == ids[:3]
    assert detok.flush() == "" and detok.add(ids[3:]) == ""


def test_stop_inside_tokens_and_no_trim(tok):
    ids = tok.encode("The capital of France is Paris.")
    detok, _ = stream(tok, ids, [8], stop=["al o"])
    assert (detok.text, detok.output_ids) == ("The capit", ids[:3])
    detok, deltas = stream(tok, ids, [1], stop=["al o"], no_stop_trim=True)
    assert "".join(deltas) == detok.text == "The capital o"


def test_held_back_text_released(tok):
    ids = tok.encode("The capital city")
    detok = IncrementalDetokenizer(tok, stop=["capital of"])
    assert [detok.add([i]) for i in ids] == ["The", " ", "capital city"]
    detok = IncrementalDetokenizer(tok, stop=["capital of"])
    assert detok.add(ids[:2]) == "The " and detok.flush() == "capital"
    assert detok.text == "The capital" and detok.stop_matched is None


def test_earliest_stop_wins(tok):
    ids = tok.encode("The capital of France is Paris.")
    detok, _ = stream(tok, ids, [len(ids)], stop=["Paris", "France", "capital"])
    assert detok.stop_matched == "capital" and detok.text == "The "
    # Both end inside the same token: the one that ends first wins.
    detok, _ = stream(tok, ids, [len(ids)], stop=["pital", "cap"])
    assert detok.stop_matched == "cap" and detok.output_ids == ids[:2]


def test_stop_completed_by_token_that_starts_a_character(tok):
    ids = tok.encode("👋🏽 café 日本語 ✓")
    k = next(k for k in range(len(ids)) if tok.decode(ids[:k]).startswith("👋🏽 café "))
    assert tok.decode(ids[:k]).endswith("\ufffd")  # the space comes with half of "日"
    for sizes in ([1], [len(ids)]):
        detok, _ = stream(tok, ids, sizes, stop=["café "])
        assert (detok.text, detok.output_ids) == ("👋🏽 ", ids[:k])


def test_special_tokens(tok):
    ids = tok.encode("Hi<|im_end|>\n<|im_start|>user")
    detok, _ = stream(tok, ids, [1])
    assert detok.text == "Hi\nuser"
    detok, _ = stream(tok, ids, [1], skip_special_tokens=False)
    assert detok.text == "Hi<|im_end|>\n<|im_start|>user"
    detok, _ = stream(tok, ids, [1], skip_special_tokens=False, stop=["<|im_end|>"])
    assert detok.text == "Hi" and detok.output_ids == ids[:2]


def test_flush_emits_incomplete_character(tok):
    ids = tok.encode("ok 👋")
    detok = IncrementalDetokenizer(tok)
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    assert detok.add(ids[:cut]) == "ok"
    tail = detok.flush()
    assert "ok" + tail == tok.decode(ids[:cut]) and tail.endswith("\ufffd")


def test_prompt_context(tok):
    prompt = tok.encode("<|im_start|>assistant\n")
    ids = tok.encode(" Hello there")
    detok, _ = stream(tok, ids, [1], prompt_ids=prompt)
    assert detok.text == " Hello there" and detok.output_ids == ids


def test_prompt_context_keeps_leading_space():
    # A SentencePiece-style decoder drops the first token's leading space; after the prompt's
    # last tokens it keeps it, so the answer reads as it does in the full text.
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models

    vocab = {"▁Q:": 0, "▁Hello": 1, "▁there": 2}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="▁Q:"))
    raw.decoder = decoders.Metaspace()
    raw = Tokenizer(raw, {})
    detok, deltas = stream(raw, [1, 2], [1])
    assert deltas == ["Hello", " there", ""]
    detok, deltas = stream(raw, [1, 2], [1], prompt_ids=[0])
    assert deltas == [" Hello", " there", ""] and detok.output_ids == [1, 2]


def test_invalid_stop(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, stop=["ok", ""])


class StreamOnly:
    """A tokenizer whose every token goes through DecodeStream (no whole-token lookup)."""

    whole_texts = None

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def __getattr__(self, name: str):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def gemma():
    from tests.models import gemma3_gguf
    from unison.model.weights.loader import resolve_model_dir

    return Tokenizer.from_dir(resolve_model_dir(gemma3_gguf()))


def test_whole_token_lookup_is_for_per_token_decoders_only(tok, gemma):
    """Byte-level BPE and Gemma's Replace + ByteFallback + Fuse decode token by token; Metaspace and
    Strip treat a text's first token otherwise, so their tokens always go through the stream."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models

    assert tok.whole_texts is not None and gemma.whole_texts is not None
    strip = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    for decoder in (decoders.Metaspace(), strip):
        raw = RawTokenizer(models.WordLevel({"▁Hello": 0}, unk_token="▁Hello"))
        raw.decoder = decoder
        assert Tokenizer(raw, {}).whole_texts is None
    ids = tok.encode("café 👋")  # c, af, é, then the emoji's bytes over three tokens
    assert [tok.whole_text(i) for i in ids] == ["c", "af", "é", None, None, None]


@FAST
@given(data=st.data(), sizes=sizes_st, skip=st.booleans(), context=st.integers(0, 6))
def test_whole_token_lookup_gives_the_streams_deltas(tok, gemma, data, sizes, skip, context):
    """Delta for delta what DecodeStream alone gives, for sampled ids (stray bytes of split
    characters, special tokens, emoji) and for text, after a prompt or none, in chunks."""
    for t, vocab in ((tok, 49152), (gemma, 262144)):
        ids = data.draw(st.one_of(
            st.lists(st.integers(0, vocab - 1), max_size=40),
            st.sampled_from(TEXTS).map(t.encode),
            st.lists(st.sampled_from(sorted({i for s in TEXTS for i in t.encode(s)})), max_size=40)))
        prompt = t.encode(data.draw(st.sampled_from(TEXTS)))[-context:] if context else None
        got = stream(t, ids, sizes, skip_special_tokens=skip, prompt_ids=prompt)
        want = stream(StreamOnly(t), ids, sizes, skip_special_tokens=skip, prompt_ids=prompt)
        assert got[1] == want[1] and got[0].output_ids == want[0].output_ids
