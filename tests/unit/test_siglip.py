"""Gemma 3's vision tower and projector against transformers' own, on a tiny random model: in
memory, from what save_pretrained writes, under the published checkpoints' names; and the
loader's and config's errors."""

from __future__ import annotations

import json

import pytest
import torch

from unison.model.vision.siglip import Gemma3Vision, VisionConfig
from unison.model.weights.sources import DictWeights, SafetensorsWeights

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=24),
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
            patch_size=8, vision_use_head=False),
        mm_tokens_per_image=16)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # transformers zeroes biases and the projection: make every weight count
        for name, param in model.named_parameters():
            if "language_model" not in name:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "layer_norm" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def expected(hf_model):
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixels).pooler_output
    assert out.shape == (2, 16, 48) and out.abs().max() > 0.1
    return pixels, out


def vision_cfg(model) -> VisionConfig:
    return VisionConfig.from_hf(model.config.to_dict())


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_matches_transformers_in_memory(hf_model, expected):
    pixels, out = expected
    vision = Gemma3Vision.load(DictWeights(state(hf_model)), vision_cfg(hf_model))
    got = vision(pixels)
    assert got.dtype == torch.float32 and got.shape == out.shape
    assert (got - out).abs().max() <= 1e-5
    tower = [p for n, p in hf_model.named_parameters() if "language_model" not in n and "lm_head" not in n]
    assert vision.nbytes == sum(p.numel() for p in tower) * 4


def test_matches_transformers_from_save_pretrained(hf_model, expected, tmp_path):
    pixels, out = expected
    hf_model.save_pretrained(tmp_path)
    cfg = VisionConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg == VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=64,
                               patch_size=8, layer_norm_eps=1e-6, text_hidden_size=48, mm_tokens_per_image=16,
                               image_token_id=262_144, boi_token_id=255_999, eoi_token_id=256_000)
    weights = SafetensorsWeights(tmp_path)
    assert "vision_tower.encoder.layers.0.self_attn.q_proj.weight" in weights  # transformers 5's names
    assert (Gemma3Vision.load(weights, cfg)(pixels) - out).abs().max() <= 1e-5


def test_published_names_and_bfloat16(hf_model, expected):
    """google/gemma-3-*-it name the tower vision_tower.vision_model.* and the projector
    multi_modal_projector.*."""
    pixels, out = expected
    renamed = {k.replace("model.vision_tower.", "vision_tower.vision_model.")
                .replace("model.multi_modal_projector.", "multi_modal_projector."): v
               for k, v in state(hf_model).items()}
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in renamed
    assert (Gemma3Vision.load(DictWeights(renamed), vision_cfg(hf_model))(pixels) - out).abs().max() <= 1e-5
    half = Gemma3Vision.load(DictWeights(renamed), vision_cfg(hf_model), dtype=torch.bfloat16)
    got = half(pixels)
    assert got.dtype == torch.float32 and (got - out).abs().max() <= 0.05 * out.abs().max()


def test_missing_and_misshaped_tensors(hf_model):
    cfg = vision_cfg(hf_model)
    missing = state(hf_model)
    del missing["model.vision_tower.encoder.layers.1.mlp.fc2.bias"]
    with pytest.raises(ValueError, match=r"model\.vision_tower\.encoder\.layers\.1\.mlp\.fc2\.bias"):
        Gemma3Vision.load(DictWeights(missing), cfg)
    wrong = state(hf_model)
    wrong["model.vision_tower.embeddings.position_embedding.weight"] = torch.zeros(63, 32)
    with pytest.raises(ValueError, match=r"model\.vision_tower\.embeddings\.position_embedding\.weight"):
        Gemma3Vision.load(DictWeights(wrong), cfg)
    text_only = {k: v for k, v in state(hf_model).items() if "multi_modal_projector" not in k}
    with pytest.raises(ValueError, match="mm_input_projection_weight"):
        Gemma3Vision.load(DictWeights(text_only), cfg)
    with pytest.raises(ValueError, match="pixel_values"):
        Gemma3Vision.load(DictWeights(state(hf_model)), cfg)(torch.zeros(1, 3, 56, 56))


def test_config_defaults_and_refusals():
    cfg = VisionConfig.from_hf({"vision_config": {"image_size": 896, "patch_size": 14}})  # else defaults
    assert (cfg.hidden_size, cfg.num_layers, cfg.layer_norm_eps, cfg.text_hidden_size) == (
        768, 12, 1e-6, 2304)
    assert (cfg.mm_tokens_per_image, cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (
        256, 262_144, 255_999, 256_000)
    with pytest.raises(ValueError, match="mm_tokens_per_image"):  # bare defaults: 16 a side, 14 patches
        VisionConfig.from_hf({})
    with pytest.raises(ValueError, match=r"vision_config\.image_size"):
        VisionConfig.from_hf({"vision_config": {"image_size": 65, "patch_size": 8}})
    with pytest.raises(ValueError, match="mm_tokens_per_image"):  # 3 tokens a side, 8 patches a side
        VisionConfig.from_hf({"vision_config": {"image_size": 64, "patch_size": 8}, "mm_tokens_per_image": 9})
    with pytest.raises(ValueError, match="mm_tokens_per_image"):  # not a square
        VisionConfig.from_hf({"vision_config": {"image_size": 64, "patch_size": 8}, "mm_tokens_per_image": 8})
    with pytest.raises(ValueError, match=r"vision_config\.num_attention_heads"):
        VisionConfig.from_hf({"vision_config": {"hidden_size": 30, "num_attention_heads": 4}})
    with pytest.raises(ValueError, match=r"vision_config\.patch_size"):
        VisionConfig.from_hf({"vision_config": {"patch_size": 0}})
    with pytest.raises(ValueError, match=r"vision_config\.hidden_act"):
        VisionConfig.from_hf({"vision_config": {"hidden_act": "relu"}})
