"""LoRA adapters for tests, made by PEFT itself, and what transformers + PEFT compute with them.

    make_adapter(tmp / "a", rank=4, seed=1)          # a PEFT directory, as save_pretrained writes it
    peft_reference(tmp / "a", prompts, 16)          # greedy ids and top-5 logprobs, transformers + PEFT

The base is the embedded model's float checkpoint: the tensors transformers' GGUF loader builds
(tests/utils.py hf_model, cached per machine), or an HF directory's own weights.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Each module's update scale * B @ A is this fraction of its base weight (Frobenius norms): the
# outputs change visibly (other greedy tokens) and stay sane text.
RELATIVE_DELTA = 0.05


def base_model(model_dir: str | Path | None = None):
    """A fresh float32 transformers model of `model_dir` (None: the embedded model's dequantized
    GGUF): a copy, as PEFT rewrites the model it wraps, of one built once per process."""
    return copy.deepcopy(_base_model(str(model_dir) if model_dir else None))


@functools.cache
def _base_model(model_dir: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir is not None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from tests.utils import hf_model

    return hf_model()  # the embedded GGUF as transformers' own loader builds it (cached per machine)


def make_adapter(out_dir: str | Path, *, targets=ALL_TARGETS, rank: int = 8, alpha: float = 16,
                 seed: int = 0, use_rslora: bool = False, model_dir: str | Path | None = None) -> Path:
    """A PEFT LoRA adapter of the embedded model (or `model_dir`'s) saved in `out_dir`, with
    seeded random A and B (PEFT starts B at zero, an adapter that changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    out_dir = Path(out_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base_model(model_dir), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "lora_A") or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_((torch.rand(a.shape, generator=g) * 2 - 1) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=g))
            delta = module.scaling["default"] * (b @ a)
            b.mul_(RELATIVE_DELTA * module.base_layer.weight.norm() / delta.norm())
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(adapter_dir: str | Path, model_dir: str | Path | None = None):
    """transformers + PEFT with the adapter as saved (read back by PEFT, not made in memory)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model(model_dir), str(adapter_dir)).eval()


def peft_reference(adapter_dir: str | Path, prompts_ids: list[list[int]], max_new_tokens: int,
                   model_dir: str | Path | None = None) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy continuations by transformers + PEFT, one prompt at a time: (ids, top-5 logprobs
    at each new position) per prompt, the first step's being the first-step logprobs. Kept in the
    test-model cache (tests/references.py), keyed by the adapter's weights, its config, the base
    and this code."""
    from tests.references import cached_reference, file_sha256
    from tests.utils import _gguf, _hf_greedy, _hf_rebuilt
    from unison.model.weights.loader import default_gguf_path

    adapter_dir = Path(adapter_dir)
    base = Path(model_dir) / "model.safetensors" if model_dir else _gguf(default_gguf_path())
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if isinstance(config.get("target_modules"), list):  # saved from a set: in any order
        config["target_modules"] = sorted(config["target_modules"])
    code = "\n".join([inspect.getsource(_base_model), inspect.getsource(_hf_rebuilt),
                      inspect.getsource(peft_model), inspect.getsource(_hf_greedy),
                      json.dumps(config, sort_keys=True),
                      file_sha256(base) if base.is_file() else str(model_dir)])
    return cached_reference(adapter_dir / "adapter_model.safetensors", code, prompts_ids, max_new_tokens,
                            lambda: _hf_greedy(peft_model(adapter_dir, model_dir), prompts_ids,
                                               max_new_tokens))
