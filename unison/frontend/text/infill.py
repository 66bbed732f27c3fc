"""Fill-in-the-middle prompts, from the model's own FIM tokens: llama-server's /infill, Ollama's
`suffix`, and OpenAI's completions `suffix` all build their prompt here.

The prompt is prefix-suffix-middle, as llama.cpp writes it: [file_sep name\\n text]... for extra
files (where the model has a file separator), then PRE prefix SUF suffix MID, and the model
writes the middle. A model without FIM tokens has no such prompt: the routes refuse it by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from unison.frontend.text.tokenizer import Tokenizer

# (prefix, suffix, middle, file separator) as each family spells them.
STYLES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"),  # StarCoder, Granite
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None),  # CodeLlama
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    file_sep: int | None

    def prompt(self, tokenizer: Tokenizer, prefix: str, suffix: str, middle: str = "",
               extra: list[tuple[str, str]] | None = None) -> list[int]:
        """The ids of a fill-in-the-middle prompt; `middle`: text the answer must start with, and
        `extra`: other files (name, text) shown first, as context."""
        def ids(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)
        head: list[int] = []
        for name, text in extra or []:
            head += ([self.file_sep] + ids(f"{name}\n") if self.file_sep is not None else []) + ids(text)
        bos = tokenizer.encode("", add_special_tokens=True)  # what the model's tokenizer starts with
        return (bos + head + [self.prefix] + ids(prefix) + [self.suffix] + ids(suffix) + [self.middle]
                + ids(middle))


def fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """The model's FIM tokens, None if its vocabulary has none."""
    for style in STYLES:
        ids = [tokenizer.token_id(t) if t is not None else None for t in style]
        if None not in ids[:3]:
            prefix, suffix, middle, sep = ids
            assert prefix is not None and suffix is not None and middle is not None
            return FimTokens(prefix, suffix, middle, sep)
    return None
