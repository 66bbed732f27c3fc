"""Request: one sequence in the core. It keeps counters; the rest is derived."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from unison.sampling import MAX_TOP_LOGPROBS, core_problem
from unison.wire.messages import CoreSamplingParams, Generate, ImageInput, ImageSpec

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from unison.core.kv.radix_cache import Node


@dataclass(slots=True, eq=False)
class Request:
    frontend: bytes  # the ZMQ identity of the frontend that owns it
    rid: str
    token_ids: list[int]  # prompt, then outputs
    num_prompt_tokens: int
    params: CoreSamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    priority: int = 0  # higher is admitted first
    adapter: int = 0  # the LoRA adapter's id in the core's registry; 0: the base model
    adapter_waits: int = 0  # admissions it was passed over for the step's adapter limit
    token_ids_logprob: list[int] = field(default_factory=list)  # ids whose logprobs are returned
    pooling: bool = False  # embed or score the prompt: the runner's row of its last token is the result
    held: bool = False  # arrived while a weight update waits: admitted once it is done
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # its first step (queue time ends)
    first_token_at: float | None = None  # step times, for TTFT and inter-token latency
    last_token_at: float | None = None
    block_table: list[int] = field(default_factory=list)
    state_slot: int = -1  # its linear-attention state's slot (a hybrid model's), held with its blocks
    state_restore: int = -1  # a prefix-cache snapshot its first step resumes from (a hybrid's hit)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    next_prompt_logprob: int = -1  # next prompt position whose logprob is owed (see __post_init__)
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cache_node: Node | None = None  # the radix cache node this request holds locked
    finish: str | None = None
    matched: int | None = None
    grammar: Future[LLMatcher] | None = None  # the request's matcher, once compiled (see core/grammar.py)
    grammar_started: bool = True  # False until params.grammar_after appeared in the output
    draft_misses: int = 0  # speculative decoding: drafts in a row with nothing accepted
    drafts_resume_at: int = 0  # ... and the step from which it drafts again after them
    draft_length: int = 0  # the next draft's length, from the last one's acceptance (0: the most)
    images: list[ImageInput] = field(default_factory=list)  # its prompt's, in order

    @property
    def cache_ids(self) -> list[int]:
        """token_ids as the prefix cache and KV events know them: each image's placeholder run
        as an id of its own hash (ImageInput.hash: a different picture is a miss; the same
        picture again is a hit), out of the vocabulary's range."""
        if not self.images:
            return self.token_ids
        ids = list(self.token_ids)
        for image in self.images:
            ids[image.offset: image.offset + image.tokens] = [image_key(image.hash)] * image.tokens
        return ids

    def image_span(self, position: int) -> tuple[int, int] | None:
        """The [start, end) of the image whose placeholders hold `position` and see one another
        (Gemma 3's; a grid image's tokens are causal, as Qwen's: a chunk may cut them), if one does."""
        for image in self.images:
            if image.grid is None and image.offset <= position < image.offset + image.tokens:
                return image.offset, image.offset + image.tokens
        return None

    @property
    def ready(self) -> bool:
        """Admissible: not held, and no grammar or its matcher compiled (or failed: refused)."""
        return not self.held and (self.grammar is None or self.grammar.done())

    @property
    def matcher(self) -> LLMatcher:
        """The compiled matcher of a request with a grammar."""
        assert self.grammar is not None
        return self.grammar.result()

    @property
    def constrained(self) -> bool:
        """Whether the grammar holds the next token (it may start only after a reasoning section)."""
        return self.grammar is not None and self.grammar_started

    def __post_init__(self) -> None:
        self.grammar_started = not self.params.grammar_after
        start = self.logprob_start_len
        self.next_prompt_logprob = start if 0 <= start < self.num_prompt_tokens else self.num_prompt_tokens

    @classmethod
    def from_message(cls, frontend: bytes, msg: Generate) -> Request:
        return cls(
            frontend=frontend, rid=msg.rid, token_ids=list(msg.input_ids),
            num_prompt_tokens=len(msg.input_ids), params=msg.params,
            return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len, priority=msg.priority,
            token_ids_logprob=list(msg.token_ids_logprob), pooling=msg.pooling, images=list(msg.images),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.next_prompt_logprob < self.num_prompt_tokens


def image_key(digest: bytes) -> int:
    """An image's placeholder id in cache keys: 2**40 and up, never a vocabulary's token."""
    return (1 << 40) | int.from_bytes(digest[:4], "big")


def check_images(msg: Generate, spec: ImageSpec | None) -> str | None:
    """What makes a request's images unusable (a frontend may be buggy or not ours), or None."""
    if not msg.images:
        return None
    if spec is None:
        return "this model takes no images (a text-only model)"
    end = 0
    for i, image in enumerate(msg.images):
        problem = _grid_problem(image, spec)
        if problem is not None:
            return f"images[{i}].grid: {problem}"
        shape, tokens = _image_shape(image, spec)
        if image.shape != shape or len(image.pixels) != 4 * math.prod(shape) or len(image.hash) < 4:
            return f"images[{i}]: an image must be float32 pixels of shape {shape} with its hash"
        run = msg.input_ids[image.offset: image.offset + image.tokens]
        if image.offset < end or image.tokens != tokens or run != [spec.token_id] * tokens:
            return (f"images[{i}]: each image must sit on its own run of {tokens} placeholder tokens "
                    f"{spec.token_id}, in order")
        end = image.offset + image.tokens
    return None


def _grid_problem(image: ImageInput, spec: ImageSpec) -> str | None:
    """What is wrong with an image's grid of patches, or None: a fixed-size image (Gemma 3's,
    whose rows see their whole image) has none; a grid image's is one frame of whole tokens within
    the processor's pixel bounds (the tower's attention grows with its square: a frontend that
    sent a huge one would stall every step)."""
    p, grid = spec.patches, image.grid
    if p is None or grid is None:
        if p is None and grid is None:
            return None
        return f"this model's images {'have no' if p is None else 'need a'} grid of patches"
    m = p.merge_size
    if grid[0] != 1 or min(grid) < 1 or grid[1] % m or grid[2] % m:
        return f"must be (1, rows, columns), rows and columns multiples of {m}, got {grid}"
    pixels = grid[1] * grid[2] * p.patch_size ** 2
    if pixels > 2 * max(p.max_pixels, p.min_pixels):  # (smart_resize stays within max_pixels)
        return f"{grid[1]}x{grid[2]} patches is over the processor's max_pixels ({p.max_pixels})"
    return None


def _image_shape(image: ImageInput, spec: ImageSpec) -> tuple[tuple[int, ...], int]:
    """The pixels' shape the image must have, and its placeholders (its grid checked first)."""
    p = spec.patches
    if p is None or image.grid is None:
        return (3, spec.image_size, spec.image_size), spec.tokens
    rows, cols = image.grid[1], image.grid[2]
    return (rows * cols, 3 * p.patch_size ** 2), rows * cols // p.merge_size ** 2


def check_generate(msg: Generate, vocab_size: int, context_length: int, task: str = "generate",
                   image: ImageSpec | None = None) -> str | None:
    """What makes a request unservable, or None. The frontend validates for its users; the core
    re-checks everything that could crash a step or corrupt its state, since a frontend may be
    buggy or not ours."""
    n, p = len(msg.input_ids), msg.params
    if n == 0:
        return "input_ids is empty"
    if msg.pooling != (task != "generate"):
        return ("this model serves 'generate': it does not embed or score" if task == "generate" else
                f"this model serves {task!r}, not generation: use encode, rerank or score "
                "(/v1/embeddings, /v1/rerank, /score)")
    if msg.pooling and (p.max_new_tokens or msg.return_logprob or p.grammar is not None):
        return "a pooling request generates nothing: max_new_tokens 0, no logprobs, no grammar"
    if not 0 <= p.max_new_tokens <= context_length - n:
        return (f"prompt ({n} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                f"context length ({context_length})")
    ids = [*msg.input_ids, *p.stop_token_ids, *p.logit_bias, *msg.token_ids_logprob]
    if min(ids) < 0 or max(ids) >= vocab_size:
        return f"token ids must be in [0, {vocab_size - 1}]"
    if (problem := core_problem(p)) is not None:
        return problem
    if not 0 <= msg.top_logprobs_num <= MAX_TOP_LOGPROBS or msg.logprob_start_len < -1:
        return f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}] and logprob_start_len >= -1"
    return check_images(msg, image)
