"""Long context: a 16k-token prompt on a family with a 32k context (Qwen2's shape: rope theta 1e6)
gives transformers' greedy tokens, through the whole core (chunked prefill over 1,000+ paged
blocks, then decode). A tiny random model keeps both sides fast; fp32 on both."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.unit.test_model import tiny_model
from unison.config import EngineConfig
from unison.core.engine_core import EngineCore
from unison.wire.messages import CoreSamplingParams, Generate

PROMPT_LEN, STEPS = 16384, 16


def test_a_16k_prompt_gives_transformers_greedy_tokens(tmp_path: Path):
    hf = tiny_model("qwen2-qkv-bias", tmp_path, max_position_embeddings=32768, rope_theta=1e6,
                    tie_word_embeddings=False)
    ids = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
    want = ref[0, PROMPT_LEN:].tolist()

    config = EngineConfig(model_path=str(tmp_path), quantization="none", num_threads=2,
                          max_total_tokens=PROMPT_LEN + 64, chunked_prefill_size=2048)
    core = EngineCore(config, str(tmp_path))
    try:
        assert core.context_length == 32768
        params = CoreSamplingParams(max_new_tokens=STEPS, ignore_eos=True, temperature=0.0)
        core.add(b"fe", Generate("long", ids, params))
        got: list[int] = []
        while core.has_work:
            for out in core.step().get(b"fe", []):
                got += out.token_ids
    finally:
        core.close()
    assert got == want
