"""Prompt sources for the benchmarks: seeded random prompts, quiz transcripts, or a
ShareGPT-format JSON file.

They give `SampleRequest`s of text (the serving client needs no tokenizer), or, for the offline
benchmarks, random token ids of exact lengths. Random text is common English words, one word ≈
one token for BPE vocabularies; ShareGPT lengths are counted with a `tokenizer.json` when one is
given, else estimated (words and punctuation marks).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Short, frequent words: nearly all are a single token (with their leading space) in the
# vocabularies of Llama, Qwen, Mistral, GPT-2 and their kin.
WORDS = tuple(dict.fromkeys("""
the of and to in is was for that on as with by he at from his it an were are which this be or
has had not first one their its new after who they have her she two been other when there all
during into school time may years more most only over city some world would where later up such
used many can state about national out known university united then made also three while team
city under part between well year people found both government became these film world work
second through city century area no series before than life day well so river back state we
great small head early light long place made home water room mother family house point side
hand night word kind number sound good give tell name line right turn show large spell air end
does move play real little round open start story food sea near land girl boy child old change
book paper music food money car table door window tree field road town market game music art
story word answer study learn plant cover food sun four between state keep eye never last let
thought city tree cross farm hard start might story saw far sea draw left late run while press
close night real life few north open seem together next white children begin got walk example
ease paper group always music those both mark often letter until mile river car feet care
second enough plain girl usual young ready above ever red list though feel talk bird soon body
dog family direct pose leave song measure door product black short class wind question happen
complete ship half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several toward
war lay against pattern slow center love person money serve appear road map rain rule govern
pull cold notice voice unit power town fine certain fly fall lead cry dark machine note wait
plan figure star box noun field rest correct able pound done beauty drive stood contain front
teach week final gave green oh quick develop ocean warm free minute strong special mind behind
clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane
dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring
yes distant fill east paint language among
""".split()))


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (offline: exact lengths)
    prompt_len: int  # tokens, as well as the client can tell
    output_len: int  # max_tokens to ask for


def sample_lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    # vLLM's random dataset: uniform in [mean * (1 - r), mean * (1 + r)], inclusive.
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    # Ids from the ordinary part of the vocabulary: no special tokens inside prompts.
    return [rng.randrange(1000, vocab - 1000) for _ in range(length)]


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, vocab: int | None = None) -> list[SampleRequest]:
    """vLLM's random dataset, seeded: prompts of common words, or with `vocab` of token ids from
    that vocabulary; lengths uniform in [len * (1 - r), len * (1 + r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    ins = sample_lengths(rng, n, input_len, range_ratio)
    outs = sample_lengths(rng, n, output_len, range_ratio)

    def prompt(length: int) -> str | list[int]:
        return random_ids(rng, length, vocab) if vocab else " ".join(rng.choices(WORDS, k=length))
    return [SampleRequest(prompt(i), i, o) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_requests(n: int, groups: int, system_len: int, question_len: int, output_len: int,
                           seed: int = 0) -> list[SampleRequest]:
    """SGLang's generated-shared-prefix workload: `groups` system prompts of `system_len` words,
    each followed by its own questions of `question_len` words; n requests in a shuffled order."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(WORDS, k=system_len)) for _ in range(groups)]
    reqs = [SampleRequest(f"{systems[i % groups]}\n{' '.join(rng.choices(WORDS, k=question_len))}",
                          system_len + question_len, output_len) for i in range(n)]
    rng.shuffle(reqs)
    return reqs


# Input-grounded work, where the answer copies much of the prompt: what speculative decoding with
# prompt lookup is for. Documents are assembled from these sentences and records, seeded.
SENTENCES = (
    "The river that runs through the old town floods almost every spring.",
    "Most of the houses near the water were built on raised stone floors for that reason.",
    "The market opens at six in the morning and closes shortly after noon.",
    "Farmers bring vegetables, cheese and bread from the villages in the hills.",
    "A small museum next to the bridge shows tools and maps from the last three centuries.",
    "The school was moved to a larger building on the north side of the town in 1987.",
    "Every summer the town holds a music festival that lasts for two weeks.",
    "Visitors often take the train from the capital, which takes about two hours.",
    "The library keeps a collection of letters written by the town's first mayor.",
    "In winter the main road over the pass is closed because of snow.",
    "The local football team plays its home games in a field behind the church.",
    "A new bicycle path now connects the station with the lake to the south.",
    "The bakery on the corner has been run by the same family for four generations.",
    "Several old mills along the river have been turned into shops and small offices.",
    "The town council meets on the first Monday of every month in the hall by the square.",
    "Children learn to swim in the lake, where the water stays warm until September.",
)
TYPOS = {"the": "teh", "which": "wich", "because": "becuase", "every": "evry", "their": "thier",
         "small": "smal", "morning": "mornign", "water": "watter", "built": "biult", "family": "famliy"}
NAMES = ("Alice Martin", "Bruno Costa", "Chen Wei", "Dana Novak", "Emil Berg", "Fatima Khan",
         "Goran Ilic", "Hana Sato", "Ivan Petrov", "Julia Weber", "Kofi Mensah", "Lena Fischer")
CITIES = ("Lisbon", "Oslo", "Kyoto", "Accra", "Zagreb", "Vienna", "Lima", "Perth")
GROUNDED_KINDS = ("repeat", "fix", "extract", "json")


def grounded_prompt(kind: str, rng: random.Random) -> str:
    """One input-grounded task: repeat a text, fix its typos, extract records, or reformat JSON."""
    text = " ".join(rng.sample(SENTENCES, 6))
    people = [{"name": n, "city": rng.choice(CITIES), "age": rng.randint(20, 70)}
              for n in rng.sample(NAMES, 8)]
    if kind == "repeat":
        return f"Repeat the following text exactly, word for word.\n\n{text}"
    if kind == "fix":
        broken = " ".join(TYPOS.get(w, w) for w in text.split())
        return f"Fix the spelling mistakes in this text. Reply with the corrected text only.\n\n{broken}"
    if kind == "extract":
        rows = "\n".join(f"{p['name']}, {p['age']}, lives in {p['city']}" for p in people)
        return f"Turn each line into JSON with the keys name, age and city, one object per line.\n\n{rows}"
    if kind == "json":
        return ("Rewrite this JSON with one key per line, keeping every value.\n\n"
                + json.dumps({"people": people}, separators=(",", ":")))
    raise ValueError(f"grounded prompt kind must be one of {GROUNDED_KINDS}, got {kind!r}")


def grounded_chats(encode: Callable[[str], list[int]], render: Callable[[str], list[int]], n: int,
                   tokens: int) -> list[list[int]]:
    """n prompts of `tokens` tokens or a little more: grounded tasks one after another in one
    message, each task's kind picked by the text's length so far (`encode` counts its tokens;
    `render`: the message's ids in the model's chat template), seeded by the prompt's index."""
    prompts = []
    for i in range(n):
        rng, text = random.Random(100 + i), ""
        while (count := len(encode(text))) < tokens:
            text += grounded_prompt(GROUNDED_KINDS[count % len(GROUNDED_KINDS)], rng) + "\n\n"
        prompts.append(render(text))
    return prompts


def grounded_requests(n: int, output_len: int, seed: int = 0,
                      kinds: tuple[str, ...] = GROUNDED_KINDS) -> list[SampleRequest]:
    """n input-grounded requests, the kinds in turn (seeded documents)."""
    rng = random.Random(seed)
    prompts = [grounded_prompt(kinds[i % len(kinds)], rng) for i in range(n)]
    return [SampleRequest(p, estimate_tokens(p), output_len) for p in prompts]


_PIECES = re.compile(r"\w+|[^\w\s]")


def estimate_tokens(text: str) -> int:
    """Words and punctuation marks: close to a BPE count for prose, low for code."""
    return len(_PIECES.findall(text))


def load_tokenizer_counter(path: str) -> Callable[[str], int]:
    """Token counter from a `tokenizer.json` (or a directory holding one)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    tok = Tokenizer.from_file(str(p))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    for i, turn in enumerate(conversation[:-1]):
        if turn.get("from") in ("human", "user"):
            reply = conversation[i + 1]
            if reply.get("from") in ("gpt", "assistant", "chatgpt", "bard"):
                return turn.get("value") or "", reply.get("value") or ""
            return None
    return None


def sharegpt_requests(path: str, n: int, seed: int = 0, output_len: int | None = None,
                      count_tokens: Callable[[str], int] | None = None, min_len: int = 4,
                      max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle with the seed, keep the first human turn as the prompt
    and the reply's length as the output length (or `output_len` for all), skip pairs with
    fewer than 4 tokens either side, a prompt over 1,024 or a total over 2,048. When fewer than
    `n` pass, the kept ones are drawn again (seeded) to make up the number."""
    count = count_tokens or estimate_tokens
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [pair for entry in data
             if isinstance(entry, dict) and len(entry.get("conversations") or []) >= 2
             and (pair := _first_exchange(entry["conversations"])) is not None]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    kept: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(kept) == n:
            break
        prompt_len = count(prompt)
        out_len = output_len if output_len is not None else count(reply)
        if prompt_len < min_len or (output_len is None and out_len < min_len):
            continue
        if prompt_len > max_prompt_len or prompt_len + out_len > max_total_len:
            continue
        kept.append(SampleRequest(prompt, prompt_len, out_len))
    if not kept:
        raise ValueError(f"{path}: no conversation passes the length filters")
    if len(kept) < n:
        kept += [SampleRequest(r.prompt, r.prompt_len, r.output_len)
                 for r in rng.choices(kept, k=n - len(kept))]
    return kept


# 40 four-choice questions with their answers (the quantization and KV-cache checks' prompts).
QUIZ: list[dict[str, Any]] = json.loads((Path(__file__).parent / "data" / "multiple_choice.json").read_text())


def quiz_prompts(encode: Callable[[str], list[int]], n: int, tokens: int) -> list[list[int]]:
    """n quiz transcripts of `tokens` tokens or a little more: shuffled questions, each answered,
    until the last, which the model answers (seeded by the prompt's index)."""
    prompts = []
    for i in range(n):
        rng, text, ids = random.Random(i), "", list[int]()
        while len(ids) < tokens:
            item = rng.choice(QUIZ)
            choices = " ".join(f"{'ABCD'[k]}) {c}" for k, c in enumerate(item["choices"]))
            text += f"Question: {item['q']}\nChoices: {choices}\nAnswer:"
            ids = encode(text)
            text += f" {'ABCD'[item['answer']]}\n\n"
        prompts.append(ids)
    return prompts
