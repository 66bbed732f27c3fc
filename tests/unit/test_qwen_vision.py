"""Qwen3.5's and Qwen3-VL's vision tower against transformers' own, on tiny random towers: the
image's embeddings and (Qwen3-VL) its DeepStack features, over grids square and not, whose
position tables must be resampled up and down; and the config's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unison.model.vision.qwen_vision import QwenVision, QwenVisionConfig
from unison.model.weights.sources import DictWeights

transformers = pytest.importorskip("transformers")

VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 4,
          "out_hidden_size": 40, "num_position_embeddings": 36}
KINDS = {"qwen3_5": ("Qwen3_5VisionConfig", "Qwen3_5VisionModel", {}),
         "qwen3_vl": ("Qwen3VLVisionConfig", "Qwen3VLVisionModel", {"deepstack_visual_indexes": [0, 2]})}


@pytest.fixture(scope="module", params=sorted(KINDS))
def tower(request):
    config_class, model_class, extra = KINDS[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**VISION, **extra)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():  # transformers zeroes biases: make every weight count
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name and "weight" in name else 0.0))
    hf = {"vision_config": config.to_dict(), "image_token_id": 7}
    ours = QwenVision.load(DictWeights({f"model.visual.{k}": v.detach().clone()
                                        for k, v in model.state_dict().items()}),
                           QwenVisionConfig.from_hf(hf, 40, deepstack=request.param == "qwen3_vl"))
    return model, ours


@pytest.mark.parametrize("grid", [(6, 6), (4, 10), (14, 2), (2, 2)])
def test_matches_transformers(tower, grid):
    model, ours = tower
    rows, cols = grid
    patches = torch.randn(rows * cols, 3 * 4 * 4, generator=torch.Generator().manual_seed(rows * cols))
    frames = patches.view(-1, 3, 1, 16).expand(-1, 3, 2, 16).reshape(rows * cols, -1)  # a still image's
    with torch.no_grad():
        out = model(frames, grid_thw=torch.tensor([[1, rows, cols]]))
    got = ours(patches, grid)
    deep = getattr(out, "deepstack_features", None) or []
    assert got.shape == (1 + len(deep), rows * cols // 4, 40) and got.dtype == torch.float32
    for mine, theirs in zip(got, [out.pooler_output, *deep]):
        assert theirs.abs().max() > 0.1
        assert (mine - theirs).abs().max() <= 2e-5 * theirs.abs().max()


def test_bad_grid_is_refused(tower):
    _, ours = tower
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(torch.zeros(3 * 4, 48), (3, 4))


@pytest.mark.parametrize("change,match", [
    ({"hidden_act": "relu"}, "vision_config.hidden_act"),
    ({"num_position_embeddings": 40}, "must be a square"),
    ({"deepstack_visual_indexes": [5]}, "deepstack_visual_indexes"),
    ({"num_heads": 3}, "vision_config.num_heads"),
    ({"out_hidden_size": 8}, "out_hidden_size"),
])
def test_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        QwenVisionConfig.from_hf({"vision_config": VISION | change}, 40, deepstack=True)


def test_mmproj_file_gives_the_same_tower(tower, tmp_path):
    """llama.cpp's mmproj layout (written as its converter writes it: one Conv2d per frame, the
    merger as mm.0 / mm.2, DeepStack under its block's index), read back: the same outputs."""
    from unison.bench.qwen_tower import write_mmproj
    from unison.model.vision.mmproj import MmprojWeights

    model, ours = tower
    tensors = {f"model.visual.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    path = write_mmproj(tensors, ours.cfg, tmp_path / "mmproj.gguf", float16=False)
    file = MmprojWeights(path)
    cfg = file.qwen_config(40, {"<|image_pad|>": 7})
    assert cfg == ours.cfg
    patches = torch.randn(4 * 6, 48, generator=torch.Generator().manual_seed(3))
    assert torch.equal(QwenVision.load(file, cfg)(patches, (4, 6)), ours(patches, (4, 6)))
    with pytest.raises(ValueError, match="lacks the image token <"):
        file.qwen_config(40, {})
    with pytest.raises(ValueError, match="projection_dim 40 is not the text model's hidden size 64"):
        file.qwen_config(64, {"<|image_pad|>": 7})


def test_the_core_refuses_grids_a_frontend_should_not_send():
    """A frontend may be buggy or not ours: a grid on a fixed-size image (whose rows would then be
    cut by a chunk), a fixed-size image to a grid model, a grid of part tokens, one past the
    processor's pixel bounds (its attention would stall every step), pixels of the wrong size."""
    from unison.core.request import check_images
    from unison.wire.messages import CoreSamplingParams, Generate, ImageInput, ImageSpec, PatchSpec

    patches = PatchSpec(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=4096)
    qwen = ImageSpec(0, 3, 1 / 255, (0.5,) * 3, (0.5,) * 3, "<|image_pad|>", "<|image_pad|>", 7, 0, patches)
    gemma = ImageSpec(8, 2, 1 / 255, (0.5,) * 3, (0.5,) * 3, "<boi>", "<boi>" + "<img>" * 4, 7, 4)

    def ask(spec: ImageSpec, grid: tuple[int, int, int] | None, shape: tuple[int, ...],
            tokens: int) -> str | None:
        image = ImageInput(b"hash", 1, tokens, shape, bytes(4 * int(np.prod(shape))), grid)
        msg = Generate("r", [0] + [7] * tokens + [0], CoreSamplingParams(), images=[image])
        return check_images(msg, spec)

    assert ask(qwen, (1, 4, 6), (24, 48), 6) is None
    assert "have no grid" in ask(gemma, (1, 2, 2), (3, 8, 8), 4)
    assert "need a grid" in ask(qwen, None, (3, 8, 8), 4)
    assert "multiples of 2" in ask(qwen, (1, 3, 4), (12, 48), 3)
    assert "over the processor's max_pixels (4096)" in ask(qwen, (1, 40, 40), (1600, 48), 400)
    assert "float32 pixels of shape (24, 48)" in ask(qwen, (1, 4, 6), (24, 47), 6)
