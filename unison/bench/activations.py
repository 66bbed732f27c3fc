"""`unison bench activations`: what quantizing the activations costs in quality, 8 bits against the
kernels' 16 (per row and 32-block, round to nearest), on a model's exact weights.

The model runs in float32 (`quantization="none"`: a GGUF's weights are llama.cpp's dequantized
values), once as is and once with every linear's input rounded to each width, as the quantized
kernels would see it. Printed per width: the quiz's multiple-choice answers that stay the float
model's, the mean change of a choice's log-likelihood per token, and the largest change of a
first-step top-5 logprob over the quiz's prompts (the figure the parity tests bound).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when the command runs
    import torch

    from unison.frontend.text.tokenizer import Tokenizer
    from unison.model.runner import ModelRunner


def rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [m, k] with each row's 32-blocks rounded to `bits`-bit integers times a block scale."""
    import torch.nn.functional as F

    limit = 2 ** (bits - 1) - 1
    m, k = x.shape
    kp = -(-k // 32) * 32
    blocks = F.pad(x.float(), (0, kp - k)).view(m, kp // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / limit
    q = (blocks / scale.clamp_min(1e-30)).round().clamp(-limit, limit)
    return (q * scale).view(m, kp)[:, :k].to(x.dtype)


@contextmanager
def linear_inputs_rounded(bits: int | None) -> Iterator[None]:
    """Every float linear's input rounded to `bits` (None: as is) while inside."""
    from unison.model.layers import linears

    call = linears.Linear.__call__
    if bits is not None:
        linears.Linear.__call__ = lambda self, x: call(self, rounded(x, bits))  # type: ignore[method-assign]
    try:
        yield
    finally:
        linears.Linear.__call__ = call  # type: ignore[method-assign]


def loglikelihoods(runner: ModelRunner, tok: Tokenizer, items: list[dict[str, Any]]
                   ) -> list[tuple[float, int]]:
    """(log p(choice | question), its tokens) for every choice, as lm-eval scores them."""
    import torch

    from unison.model.runner import BatchItem

    seqs = []
    for item in items:
        ctx = tok.encode(f"Question: {item['q']}\nAnswer:")
        seqs += [(ctx, tok.encode(" " + c)) for c in item["choices"]]
    out, block = [], runner.block_size
    for i in range(0, len(seqs), 40):
        chunk, batch, at = seqs[i: i + 40], [], 0
        for ctx, cont in chunk:
            n = -(-(len(ctx) + len(cont)) // block)
            batch.append(BatchItem(ctx + cont, 0, list(range(at, at + n)), len(ctx) - 1))
            at += n
        logits = torch.log_softmax(runner.forward(batch), dim=-1)
        row = 0
        for _, cont in chunk:
            out.append((logits[row: row + len(cont)].gather(1, torch.tensor(cont)[:, None]).sum().item(),
                        len(cont)))
            row += len(cont) + 1
    return out


def main(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from unison.bench.datasets import QUIZ
    from unison.frontend.text.tokenizer import Tokenizer
    from unison.model.runner import BatchItem, ModelRunner

    runner = ModelRunner(args.model_path, quantization="none", num_blocks=1024)
    tok = Tokenizer.from_dir(runner.model_dir)
    prompts = [tok.encode(f"Question: {it['q']}\nAnswer:") for it in QUIZ]

    def first_steps() -> torch.Tensor:
        rows = [runner.forward([BatchItem(p, 0, list(range(8)), len(p) - 1)])[0] for p in prompts]
        return torch.log_softmax(torch.stack(rows), dim=-1)

    with linear_inputs_rounded(None):
        ref_ll, ref_lp = loglikelihoods(runner, tok, QUIZ), first_steps()
    top = ref_lp.topk(5, dim=-1).indices
    print(f"{args.model_path or 'the embedded model'}, {len(QUIZ)} quiz items, against float32:")
    for bits in (16, 8):
        with linear_inputs_rounded(bits):
            ll, lp = loglikelihoods(runner, tok, QUIZ), first_steps()
        def answer(scores: list[tuple[float, int]], i: int) -> int:
            return int(np.argmax([x for x, _ in scores[4 * i: 4 * i + 4]]))

        same = sum(answer(ref_ll, i) == answer(ll, i) for i in range(len(QUIZ)))
        per_token = np.mean([abs(a - b) / n for (a, n), (b, _) in zip(ref_ll, ll)])
        gap = (ref_lp.gather(1, top) - lp.gather(1, top)).abs().max().item()
        print(f"  {bits:>2}-bit activations: answers as float32 {same}/{len(QUIZ)}, mean |d loglik| "
              f"{per_token:.4f} nats a token, first-step top-5 logprobs within {gap:.3f}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("activations",
                       help="8- vs 16-bit activations: quiz answers and logprobs against float32")
    p.add_argument("--model-path", default=None, help="a GGUF file or model directory (default: embedded)")
    p.set_defaults(func=main)
