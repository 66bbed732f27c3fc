"""What a pooling model is and serves (an encoder; a decoder that embeds or reranks), read from
its directory without torch (the loader reads it too): `config.json`, and sentence-transformers'
`modules.json`, `1_Pooling/config.json` and `sentence_bert_config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from unison.json_types import JSONObject

ARCHITECTURES = {"BertModel": "embed", "BertForSequenceClassification": "rerank"}
# sentence-transformers' Pooling config keys, by the mode each turns on
POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                "max": "pooling_mode_max_tokens", "lasttoken": "pooling_mode_lasttoken"}
POOLING_MODES = tuple(POOLING_KEYS)
# How Qwen3-Reranker reads a pair ({instruction}, {query}, {document} are filled in): its answer,
# "yes" or "no", comes after the empty thinking section.
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def encoder_task(hf_config: JSONObject) -> str | None:
    """'embed' or 'rerank' for an encoder Unison runs; None for anything else (a decoder)."""
    for arch in hf_config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return None


def model_task(model_dir: Path) -> str:
    """What a model folder serves by itself: an encoder's task; a decoder with sentence-transformers'
    modules embeds; any other decoder generates."""
    encoder = encoder_task(json.loads((model_dir / "config.json").read_text()))
    return encoder or ("embed" if (model_dir / "modules.json").is_file() else "generate")


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    task: str  # embed | rerank
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_positions: int  # what a sequence may hold: sentence-transformers' max_seq_length if it says
    type_vocab_size: int
    sep_token_id: int | None  # a pair's second segment (token type 1) starts after the first one
    pooling: str  # one of POOLING_MODES (embed)
    normalize: bool  # L2-normalized vectors (sentence-transformers' Normalize module)
    num_labels: int  # rerank: the classifier's outputs
    sigmoid: bool  # rerank: scores through a sigmoid (CrossEncoder's default for one label)

    @classmethod
    def from_dir(cls, model_dir: Path) -> EncoderConfig:
        hf = json.loads((model_dir / "config.json").read_text())
        task = encoder_task(hf)
        if task is None:
            raise ValueError(f"{model_dir} is not an encoder model ({hf.get('architectures')})")
        act = hf.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"{model_dir}/config.json: hidden_act {act!r} is not supported (gelu is)")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{model_dir}/config.json: position_embedding_type "
                             f"{hf['position_embedding_type']!r} is not supported (absolute is)")
        pooling, normalize = _sentence_transformers_modules(model_dir) if task == "embed" else ("cls", False)
        st_config = model_dir / "sentence_bert_config.json"
        positions = hf.get("max_position_embeddings", 512)
        if st_config.is_file():
            positions = min(positions, json.loads(st_config.read_text()).get("max_seq_length") or positions)
        num_labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 1
        activation = (hf.get("sentence_transformers") or {}).get("activation_fn")
        sigmoid = num_labels == 1 if activation is None else activation.endswith("Sigmoid")
        return cls(task=task, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                   layer_norm_eps=hf.get("layer_norm_eps", 1e-12), max_positions=positions,
                   type_vocab_size=hf.get("type_vocab_size", 2), sep_token_id=_sep_token_id(model_dir),
                   pooling=pooling, normalize=normalize, num_labels=num_labels, sigmoid=sigmoid)

    @property
    def output_size(self) -> int:
        """What one sequence gives: its embedding's dimensions, or one score per label."""
        return self.hidden_size if self.task == "embed" else self.num_labels


def _sentence_transformers_modules(model_dir: Path) -> tuple[str, bool]:
    """(pooling mode, normalize) from modules.json; a plain BertModel directory: mean, no normalize."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return "mean", False
    pooling, normalize = "mean", False
    for module in json.loads(modules_file.read_text()):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _pooling_mode(json.loads((model_dir / module["path"] / "config.json").read_text()))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"{modules_file}: the sentence-transformers module {module['type']} is not "
                             "supported (Transformer, Pooling and Normalize are)")
    return pooling, normalize


def _pooling_mode(config: JSONObject) -> str:
    modes = [m for m, key in POOLING_KEYS.items() if config.get(key)]
    if len(modes) != 1 or any(config.get(k) for k in ("pooling_mode_mean_sqrt_len_tokens",
                                                      "pooling_mode_weightedmean_tokens")):
        raise ValueError(f"1_Pooling/config.json: exactly one of {POOLING_MODES} pooling is supported, "
                         f"got {config}")
    return modes[0]


def _sep_token_id(model_dir: Path) -> int | None:
    import tokenizers

    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    config_file = model_dir / "tokenizer_config.json"
    sep = json.loads(config_file.read_text()).get("sep_token", "[SEP]") if config_file.is_file() else "[SEP]"
    return tokenizers.Tokenizer.from_file(str(tokenizer_file)).token_to_id(sep)


@dataclass(frozen=True, slots=True)
class DecoderPooling:
    """A decoder served as an embedding model (Qwen3-Embedding's recipe): the last token's final
    hidden state, L2-normalized unless its sentence-transformers modules leave that out."""

    normalize: bool = True

    @classmethod
    def from_dir(cls, model_dir: Path) -> DecoderPooling:
        if not (model_dir / "modules.json").is_file():
            return cls()
        pooling, normalize = _sentence_transformers_modules(model_dir)
        if pooling != "lasttoken":
            raise ValueError(f"{model_dir}: a decoder embeds by last-token pooling (its cache holds "
                             f"each prompt once, in chunks); {pooling!r} pooling is not supported")
        return cls(normalize)


@dataclass(frozen=True, slots=True)
class DecoderReranker:
    """A decoder served as a reranker (Qwen3-Reranker's recipe): each (query, document) pair is
    written into `template` and scored P("yes") against "no" at its last token."""

    yes_id: int
    no_id: int
    template: str = QWEN3_RERANKER_TEMPLATE.replace("{instruction}", RERANK_INSTRUCTION)

    @classmethod
    def from_dir(cls, model_dir: Path) -> DecoderReranker:
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
        if yes is None or no is None:
            raise ValueError(f"task: a decoder reranks by its 'yes' and 'no' tokens; {model_dir}'s "
                             "tokenizer lacks them")
        return cls(yes, no)

