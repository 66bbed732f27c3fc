"""Tokenizer and chat template of a Hugging Face model directory, without torch or transformers.

Reads what transformers reads (tokenizer.json, tokenizer_config.json, generation_config.json,
config.json, chat_template.jinja) and renders chat templates exactly as
`transformers.PreTrainedTokenizerBase.apply_chat_template(..., tokenize=False)` does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import tokenizers
import tokenizers.decoders
from jinja2.sandbox import ImmutableSandboxedEnvironment

from unison.errors import InvalidParam
from unison.frontend.text import harmony
from unison.frontend.text.detokenizer import REPLACEMENT
from unison.json_types import JSONObject

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

ROLES = ("system", "user", "assistant", "tool")
# Names of special tokens a template may read as variables, as transformers' special_tokens_map.
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# A long text is tokenized a prefix at a time before it is refused (Tokenizer.encode's `limit`):
# the first prefix has this many characters a token; a cut through a word may add this many tokens.
PREFIX_CHARS_PER_TOKEN = 4
PREFIX_SLACK_TOKENS = 16
# Decoders that turn each token into text by itself (Fuse only joins the pieces): under them a token
# of whole characters reads the same whatever came before it. (Strip and Metaspace treat a text's
# first token otherwise, so they are not among them.)
PER_TOKEN_DECODERS = frozenset({"ByteLevel", "Replace", "ByteFallback", "Fuse"})


class Tokenizer:
    """A fast (tokenizers) tokenizer plus what a frontend needs from the model's configs."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        tokenizer_config: JSONObject,
        generation_config: JSONObject | None = None,
        model_config: JSONObject | None = None,
        chat_template: str | dict[str, str] | None = None,
    ) -> None:
        # A tokenizer.json may pad and truncate every encoding (sentence-transformers' files pad to
        # 128): a prompt is its own tokens, and a limit is checked and named, never applied unseen.
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        self.token_strings = {k: _token_str(tokenizer_config.get(k)) for k in _TEMPLATE_TOKENS}
        self.chat_template = chat_template or tokenizer_config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": ..., "template": ...}] in older files
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}
        gen, cfg = generation_config or {}, model_config or {}
        self.bos_token_id = self._id_of(self.token_strings["bos_token"])
        if self.bos_token_id is None:
            self.bos_token_id = gen.get("bos_token_id", cfg.get("bos_token_id"))
        # Chat models end a turn on tokens the tokenizer may not call eos: take them all.
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
        eos_ids += [i for i in [self._id_of(self.eos_token)] if i is not None]
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        added = tok.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        # Token id -> its text where that never depends on the tokens around it (whole_text),
        # learned as tokens are first seen; None where the decoder is not per token.
        self.whole_texts: dict[int, str | None] | None = {} if _decodes_per_token(tok) else None
        # Embedding tables are often padded past the tokenizer (Qwen): sampling sees the larger.
        self.vocab_size: int = max(
            tok.get_vocab_size(with_added_tokens=True),
            max(added, default=-1) + 1,
            cfg.get("vocab_size") or 0,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}: Unison needs a Hugging Face fast tokenizer "
                "(save one with transformers' AutoTokenizer.save_pretrained)"
            )
        p = path / "chat_template.jinja"
        default = p.read_text(encoding="utf-8") if p.is_file() else None
        template: str | dict[str, str] | None = default
        if (extra := path / "additional_chat_templates").is_dir():
            named = {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))}
            template = named | ({"default": default} if default else {})
        return cls(
            tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")),
            _read_json(path / "tokenizer_config.json") or {},
            _read_json(path / "generation_config.json"),
            _read_json(path / "config.json"),
            template,
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.token_id(token)

    def token_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (a special token's, say), None if it has none."""
        return self._tok.token_to_id(token)

    @functools.cached_property
    def harmony(self) -> HarmonyEncoding | None:
        """openai-harmony's encoding where this vocabulary speaks harmony (gpt-oss's format: its
        chats are rendered and parsed by it, not by a template), else None."""
        if not harmony.speaks_harmony({t: self.token_id(t) for t in harmony.MARKERS}):
            return None
        return harmony.load_encoding(self._tok.get_vocab(with_added_tokens=False))

    @property
    def bos_token(self) -> str | None:
        return self.token_strings["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.token_strings["eos_token"]

    def encode(self, text: str, add_special_tokens: bool = True, *, limit: int | None = None,
               field: str = "prompt") -> list[int]:
        """Token ids of `text` as `AutoTokenizer(text)` gives them: with add_special_tokens, the
        special tokens tokenizer.json's post-processor adds (a BOS for Llama, Gemma; none for
        SmolLM2), even before a BOS the text already holds. transformers 5 reads no
        add_bos_token from tokenizer_config.json for such tokenizers, so neither does this.
        Text rendered from a chat template carries its own: encode it with add_special_tokens=False.

        `limit` (a context length): a text of more tokens than that is refused (InvalidParam
        naming `field`) after tokenizing only a prefix of it, so that a huge text costs what its
        first `limit` tokens cost, not seconds."""
        if limit is not None:
            self._refuse_past(text, limit, add_special_tokens, field)
        # (the batch call without offsets: the same ids, for about a tenth less CPU than encode)
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def _refuse_past(self, text: str, limit: int, add_special_tokens: bool, field: str) -> None:
        """Tokenize growing prefixes (4 characters a token to start, then twice as many each
        time) while they are shorter than `text`; one that holds more than `limit` tokens
        (with slack for a word the cut split) proves the whole text does too. A text within the
        limit costs at most about one more full tokenizing."""
        size = PREFIX_CHARS_PER_TOKEN * (limit + PREFIX_SLACK_TOKENS)
        while size < len(text):
            n = len(self._tok.encode_batch_fast([text[:size]], add_special_tokens=add_special_tokens)[0])
            if n > limit + PREFIX_SLACK_TOKENS:
                raise InvalidParam(field, f"{field}: the prompt (more than {n - PREFIX_SLACK_TOKENS} "
                                          f"tokens) exceeds the context length ({limit})")
            size *= 2

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A (query, document) pair as a cross-encoder reads it: [CLS] first [SEP] second [SEP]."""
        return self._tok.encode(first, second, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def whole_text(self, token: int) -> str | None:
        """The text of `token` if it is whole characters and no added token, else None; learned
        into `whole_texts`. Under a per-token decoder such a token adds exactly this text after any
        text that ends on a whole character: what DecodeStream returns for it, without the call
        (a quarter of a streamed token's frontend CPU)."""
        assert self.whole_texts is not None
        text = None if token in self._added_ids else self._tok.decode([token], skip_special_tokens=False)
        self.whole_texts[token] = text = text if text and REPLACEMENT not in text else None
        return text

    def decode_stream(self, skip_special_tokens: bool, context: list[int]) -> Callable[[int], str | None]:
        """An incremental decoder: call it with each new token id; it returns the text that
        token completes, or None while a character is still incomplete. `context`: tokens
        decoded before (a prompt's last ones), whose text is not returned."""
        stream = tokenizers.decoders.DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._tok)

    def apply_chat_template(
        self,
        messages: list[JSONObject],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[JSONObject] | None = None,
        documents: list[JSONObject] | None = None,
        continue_final_message: bool = False,
        **kwargs: object,
    ) -> str:
        """Render `messages` to the prompt text; `chat_template` is a template name or source.
        `continue_final_message`: the text ends inside the last (assistant) message, so the model
        continues it, as transformers does; `kwargs` are the template's own variables
        (`enable_thinking`, ...)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidParam("continue_final_message", "continue_final_message and "
                               "add_generation_prompt cannot both be true")
        messages = normalize_messages(messages)
        template = _compile(self._template_source(chat_template, tools))
        variables = {k: v for k, v in self.token_strings.items() if v is not None} | kwargs
        text = template.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            final = messages[-1].get("content")
            if not isinstance(final, str) or not final.strip() or final.strip() not in text:
                raise InvalidParam("continue_final_message", "continue_final_message needs a last "
                                   "message with text that the chat template renders")
            text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text

    def _template_source(self, chat_template: str | None, tools: list | None) -> str:
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            name = "tool_use" if tools is not None and "tool_use" in own else "default"
            if name not in own:
                raise ValueError(
                    f"the model has several chat templates and none is the default: pass "
                    f"chat_template= one of {sorted(own)}"
                )
            return own[name]
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError(
                "the model has no chat template: send a plain prompt, or pass chat_template= "
                "a Jinja template"
            )
        return own


IMAGE: JSONObject = {"type": "image"}  # where an image was: what chat templates write their marker for


def normalize_messages(messages: object) -> list[JSONObject]:
    """Check OpenAI-style chat messages; join text parts; drop None fields as transformers does."""
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def _normalize_message(i: int, message: object) -> JSONObject:
    if not isinstance(message, dict):
        raise InvalidParam(f"messages[{i}]", f"messages[{i}] must be a dict with role and content, "
                                             f"got {message!r:.80}")
    message = {k: v for k, v in message.items() if v is not None}
    if (role := message.get("role")) not in ROLES:
        raise InvalidParam(f"messages[{i}]", f"messages[{i}]: role must be one of {ROLES}, got {role!r}")
    content = message.get("content")
    if isinstance(content, list) and IMAGE in content:  # images.take_images' parts: templates read lists
        message["content"] = [p if p == IMAGE else {"type": "text", "text": _text_part(i, j, p)}
                              for j, p in enumerate(content)]
    elif isinstance(content, list):
        message["content"] = "\n".join(_text_part(i, j, p) for j, p in enumerate(content))
    elif content is None and role == "assistant" and message.get("tool_calls"):
        pass  # an assistant turn that only calls tools has no content
    elif not isinstance(content, str):
        raise InvalidParam(f"messages[{i}]", f"messages[{i}]: content must be a string or a list of "
                                             f"text parts, got {content!r:.80}")
    return message


def _text_part(i: int, j: int, part: object) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise InvalidParam(
        f"messages[{i}].content[{j}]",
        f"messages[{i}].content[{j}]: only {{'type': 'text', 'text': str}} and image parts are "
        f"supported, got {part!r:.80}"
    )


def _read_json(path: Path) -> JSONObject | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _decodes_per_token(tok: tokenizers.Tokenizer) -> bool:
    """Whether the tokenizer's decoder (a sequence included) is made of PER_TOKEN_DECODERS only."""
    if tok.decoder is None:
        return False
    spec = json.loads(tok.decoder.__getstate__())
    steps = spec["decoders"] if spec["type"] == "Sequence" else [spec]
    return all(step["type"] in PER_TOKEN_DECODERS for step in steps)


def _token_str(token: object) -> str | None:
    # Older configs store special tokens as serialized AddedToken dicts.
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


# The Jinja environment below mirrors transformers' `_compile_jinja_template`, so that templates
# from the Hub render byte for byte the same, inside the same sandbox.


class _Generation(jinja2.ext.Extension):
    """Renders the body of `{% generation %}...{% endgeneration %}` (assistant-mask markers)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    # `dict` without the type behind it, so templates cannot reach class internals.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:  # Any: what a template passes to dict()
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:  # Any: as dict.fromkeys takes
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces refuse underscore names, which could otherwise reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:  # Any: what a template passes to namespace()
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals |= {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
        "dict": _TemplateDict(),
        "namespace": _TemplateNamespace,
    }
    return env.from_string(source)
