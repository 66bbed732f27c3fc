"""Images in for Qwen3.5 and Qwen3-VL: tiny random Qwen3_5ForConditionalGeneration (Gated
DeltaNet text layers), Qwen3VLForConditionalGeneration (DeepStack) and its MoE made with transformers,
with the embedded model's tokenizer plus the vision tokens, against transformers fed the same
pictures through its own processor (Qwen2VLImageProcessorPil): the frontend's patches and grids
bit for bit, greedy tokens and first-step logprobs (M-RoPE's positions jump after each image),
the bits alone or batched, whole or in chunks, the prefix cache and the engine."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.test_vision import picture, png
from tests.utils import top_logprobs
from unison.frontend import images
from unison.model.kernels import cpu_kernels
from unison.model.runner import BatchItem, ModelRunner

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="images run on the C attention kernel")

VOCAB = 49160  # the embedded tokenizer's 49152, the three vision tokens, room
START, END, PAD = 49152, 49153, 49154  # <|vision_start|>, <|vision_end|>, <|image_pad|>
MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 16 * 16, "longest_edge": 56 * 56},
                "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.25]}
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 4,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
          "num_position_embeddings": 16}
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2}
KINDS = {  # kind -> (config class, text config class, text options, vision options)
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5TextConfig", {
        "num_hidden_layers": 4, "head_dim": 32, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [4, 2, 2], "mrope_interleaved": True}}, {}),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLTextConfig", {
        "num_hidden_layers": 3, "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                            "mrope_interleaved": True}}, {"deepstack_visual_indexes": [0, 1]}),
    # experts fused, as transformers saves them ([experts, out, in]: unison reads both orders)
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeTextConfig", {
        "num_hidden_layers": 3, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                            "mrope_interleaved": True}}, {"deepstack_visual_indexes": [0, 1]}),
}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for part in m.content %}{% if part.type == 'image' %}" + MARKER +
            "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny(kind: str, path: Path, tokenizer_dir: Path) -> Path:
    """KINDS[kind] with seeded random weights, saved by transformers, with the embedded model's
    tokenizer plus the vision tokens, the chat template above and the processor's settings."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    name, text_name, text, vision = KINDS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, name)(
        text_config=getattr(transformers, text_name)(**TEXT, **text),
        vision_config=VISION | vision, image_token_id=PAD, vision_start_token_id=START,
        vision_end_token_id=END)
    hf = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init is near-zero; widen it so positions, heads and pictures matter
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 0.5)
    hf.save_pretrained(path)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")])
    assert tok.token_to_id("<|image_pad|>") == PAD
    tok.save(str(path / "tokenizer.json"))
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    shutil.copy(tokenizer_dir / "generation_config.json", path / "generation_config.json")
    return path


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model_dir, kind) -> Path:
    return tiny(kind, tmp_path_factory.mktemp(kind) / "tiny", model_dir)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor():
    import transformers

    return transformers.Qwen2VLImageProcessorPil(**PREPROCESSOR)


@pytest.fixture(scope="module")
def runner(tiny_dir) -> ModelRunner:
    return ModelRunner(tiny_dir, quantization="none", num_blocks=64, state_slots=4)


def prepared(runner: ModelRunner, pictures: list) -> list[images.Prepared]:
    limits = images.ImageLimits(1 << 30, 1 << 30)
    return [images.prepare(images.read(images.ImageSource(png(p), "image"), limits), runner.vision.spec)
            for p in pictures]


# ---- the frontend's patches -----------------------------------------------------------------------


@pytest.mark.parametrize("size,mode", [((64, 64), "RGB"), ((100, 37), "RGB"), ((33, 90), "RGBA"),
                                       ((640, 480), "RGB"), ((7, 5), "L"), ((3, 300), "RGB"),
                                       ((56, 57), "RGB")])
def test_patches_equal_the_hf_processor_bit_for_bit(runner, processor, size, mode):
    """Each frame of transformers' pixel_values (a still image's frames are copies: the frontend
    sends one) and its image_grid_thw; sizes under, inside and over the pixel bounds, and aspects
    that round either way."""
    image = picture(*size, mode=mode)
    ours = prepared(runner, [image])[0]
    theirs = processor(image, return_tensors="np")  # (its do_convert_rgb: white under transparency)
    grid = tuple(int(x) for x in theirs["image_grid_thw"][0])
    assert ours.grid == grid
    frames = theirs["pixel_values"].reshape(grid[1] * grid[2], 3, 2, 16)
    assert ours.pixels.dtype == np.float32 and ours.pixels.shape == (grid[1] * grid[2], 48)
    for t in range(2):
        assert np.array_equal(ours.pixels.view(np.uint32),
                              np.ascontiguousarray(frames[:, :, t]).reshape(-1, 48).view(np.uint32))


# ---- the model against transformers --------------------------------------------------------------

PROMPTS = ["What is this?", "Describe it in one word.", "Count the colours.", "Is it bright or dark?"]
PICTURES = [picture(64, 64, seed=1), picture(90, 40, seed=2), picture(30, 70, seed=3),
            picture(200, 150, seed=4)]
CASES = [(pic, text) for pic in range(len(PICTURES)) for text in range(len(PROMPTS))]  # 16 pairs


def prompt_ids(runner: ModelRunner, text: str, pictures: list) -> tuple[list[int], list]:
    """The prompt's ids with each picture's run in place (what a frontend sends), and its images."""
    from unison.frontend.text.tokenizer import Tokenizer

    raw = Tokenizer.from_dir(runner.model_dir).encode(text, add_special_tokens=False)
    return images.place(raw, prepared(runner, pictures), runner.vision.spec, "prompt")


def hf_inputs(processor, ids: list[int], pictures: list) -> dict:
    out = processor(pictures, return_tensors="pt") if pictures else {}
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": (input_ids == PAD).int(), **out}


def chat(text: str, count: int = 1) -> str:
    return f"<|im_start|>user\n{MARKER * count}{text}<|im_end|>\n<|im_start|>assistant\n"


def greedy(runner: ModelRunner, ids: list[int], placed: list, new_tokens: int) -> tuple[list[int], dict]:
    """Prefill whole, decode one token at a time; the tokens and the first step's top-5."""
    table = list(range(-(-(len(ids) + new_tokens) // runner.block_size)))
    logits = runner.forward([BatchItem(ids, 0, table, len(ids) - 1, images=placed, state_slot=0)])
    first, out = top_logprobs(logits)[0], []
    for _ in range(new_tokens):
        out.append(int(logits[-1].argmax()))
        logits = runner.forward([BatchItem([out[-1]], len(ids) + len(out) - 1, table, 0, images=placed,
                                           state_slot=0)])
    return out, first


def test_greedy_tokens_and_logprobs_equal_transformers(runner, hf, processor):
    """16 (picture, prompt) pairs: greedy tokens equal on at least 15, and every first step's
    top-5 logprobs within 1e-3 of transformers' (float32); the pictures change the answers."""
    same, answers = 0, set()
    for pic, text in CASES:
        ids, placed = prompt_ids(runner, chat(PROMPTS[text]), [PICTURES[pic]])
        assert len(placed) == 1 and placed[0].tokens == ids.count(PAD) > 1
        got, first = greedy(runner, ids, placed, 6)
        inputs = hf_inputs(processor, ids, [PICTURES[pic]])
        with torch.no_grad():
            ref = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
            theirs = top_logprobs(hf(**inputs).logits[0, -1:])[0]
        assert list(first) == list(theirs)
        assert max(abs(first[t] - theirs[t]) for t in first) < 1e-3
        same += got == ref
        answers.add(tuple(got))
    assert same >= 15 and len(answers) > 4


def test_two_pictures_and_text_after_them(runner, hf, processor):
    """Two pictures of different grids, text between and after: every row's top-5 logprobs."""
    pictures = [PICTURES[1], PICTURES[3]]
    ids, placed = prompt_ids(runner, f"<|im_start|>user\nfirst {MARKER} then {MARKER} so which?", pictures)
    table = list(range(-(-len(ids) // runner.block_size)))
    ours = runner.forward([BatchItem(ids, 0, table, 0, images=placed, state_slot=0)])
    with torch.no_grad():
        theirs = hf(**hf_inputs(processor, ids, pictures)).logits[0]
    for row in range(len(ids)):
        a, b = top_logprobs(ours[row: row + 1])[0], top_logprobs(theirs[row: row + 1])[0]
        assert list(a) == list(b) and max(abs(a[t] - b[t]) for t in a) < 1e-3, f"row {row}"


def test_bits_alone_batched_and_chunked(runner, kind, tiny_dir):
    """A picture's prompt gives the same logits alone, beside a text prompt and another
    picture's, and prefilled in chunks (cut mid-text and mid-image: Qwen's image rows are causal).
    A mixture's rows keep their bits on the experts' C kernel: int8 (its tower then in bf16)."""
    if kind.endswith("_moe"):
        runner = ModelRunner(tiny_dir, quantization="int8", num_blocks=64, state_slots=4)
    a_ids, a_images = prompt_ids(runner, chat(PROMPTS[0]), [PICTURES[0]])
    b_ids, b_images = prompt_ids(runner, chat(PROMPTS[1]), [PICTURES[2]])
    text = prompt_ids(runner, "plain words only", [])[0]

    def table(i: int, n: int) -> list[int]:
        return list(range(16 * i, 16 * i + -(-n // runner.block_size)))

    alone = runner.forward([BatchItem(a_ids, 0, table(0, len(a_ids)), len(a_ids) - 1, images=a_images,
                                      state_slot=0)])
    batched = runner.forward([
        BatchItem(text, 0, table(1, len(text)), len(text) - 1, state_slot=1),
        BatchItem(a_ids, 0, table(0, len(a_ids)), len(a_ids) - 1, images=a_images, state_slot=0),
        BatchItem(b_ids, 0, table(2, len(b_ids)), len(b_ids) - 1, images=b_images, state_slot=2)])
    assert torch.equal(batched[1], alone[0])
    cut = a_images[0].offset + 3  # inside the image
    runner.forward([BatchItem(a_ids[:cut], 0, table(3, len(a_ids)), cut - 1, images=a_images, state_slot=3)])
    chunked = runner.forward([BatchItem(a_ids[cut:], cut, table(3, len(a_ids)), len(a_ids) - cut - 1,
                                        images=a_images, state_slot=3)])
    assert (chunked[0] - alone[0]).abs().max() < 1e-4


# ---- the engine ----------------------------------------------------------------------------------

GREEDY = {"temperature": 0, "max_new_tokens": 6}


def test_engine_answers_and_caches_a_picture(tiny_dir, hf, processor, runner):
    """Engine.generate(image_data=...) gives transformers' tokens; the prompt's tokens count the
    picture's run; the same picture again is a prefix-cache hit through it, another is not."""
    from unison import Engine

    pic = PICTURES[3]
    ids, _ = prompt_ids(runner, chat(PROMPTS[0]), [pic])
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(processor, ids, [pic]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    with Engine(model_path=str(tiny_dir), quantization="none", max_running_requests=2,
                state_snapshot_interval=16) as engine:
        out = engine.generate(chat(PROMPTS[0]), GREEDY, image_data=png(pic))
        assert out["output_ids"] == ref.tolist() and out["meta_info"]["prompt_tokens"] == len(ids)
        again = engine.generate(chat(PROMPTS[0]), GREEDY, image_data=png(pic))
        assert again["output_ids"] == out["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= (ids.index(PAD) + ids.count(PAD)) // 16 * 16
        other = engine.generate(chat(PROMPTS[0]), GREEDY, image_data=png(PICTURES[0]))
        assert other["meta_info"]["cached_tokens"] <= ids.index(PAD)


# ---- over HTTP -----------------------------------------------------------------------------------

CONTEXT = 160  # room for two 200x150 pictures (48 tokens each) and the words, not four


@pytest.fixture(scope="module")
def server(tiny_dir):
    from tests.serving import serve

    yield from serve("qwen-vision", str(tiny_dir), "--served-model-name", "m", "--quantization", "none",
                     "--context-length", str(CONTEXT))


def test_every_api_answers_and_counts_the_picture(server, runner, hf, processor):
    """The chat template's one <|image_pad|> becomes the picture's run: transformers' answer
    through OpenAI chat, usage counting the run, and the same answer through Anthropic's image
    block and Ollama's images; too many pictures for the context is a 400 before anything is
    queued."""
    from tests.e2e.test_vision import data_url
    from tests.serving import assert_openai_error

    pic = PICTURES[1]
    ids, _ = prompt_ids(runner, chat(PROMPTS[2]), [pic])
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(processor, ids, [pic]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    part = {"type": "image_url", "image_url": {"url": data_url(pic)}}
    r = server.post("/v1/chat/completions", {"model": "m", "temperature": 0, "max_tokens": 6, "messages": [
        {"role": "user", "content": [part, {"type": "text", "text": PROMPTS[2]}]}]}).json()
    from unison.frontend.text.tokenizer import Tokenizer

    want = r["choices"][0]["message"]["content"]
    assert want == Tokenizer.from_dir(runner.model_dir).decode(ref.tolist())
    assert r["usage"]["prompt_tokens"] == len(ids)
    tokenized = server.post("/tokenize", {"model": "m", "messages": [  # the run counted, as queued
        {"role": "user", "content": [part, {"type": "text", "text": PROMPTS[2]}]}]}).json()
    assert tokenized["tokens"] == ids
    b64 = base64.b64encode(png(pic)).decode()  # Anthropic's image block, Ollama's images: the same answer
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    anthropic = server.post("/v1/messages", {"model": "m", "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": [block, {"type": "text", "text": PROMPTS[2]}]}]}).json()
    assert anthropic["content"][0]["text"] == want
    ollama = server.post("/api/chat", {
        "model": "m", "stream": False, "options": {"temperature": 0, "num_predict": 6},
        "messages": [{"role": "user", "content": PROMPTS[2], "images": [b64]}]})
    assert ollama.json()["message"]["content"] == want
    # no max_tokens: what the context leaves once the picture's run is placed
    r = server.post("/v1/chat/completions", {"model": "m", "temperature": 0, "ignore_eos": True, "messages": [
        {"role": "user", "content": [part, {"type": "text", "text": PROMPTS[2]}]}]}).json()
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == CONTEXT - len(ids)
    big = {"type": "image_url", "image_url": {"url": data_url(PICTURES[3])}}
    r = server.post("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [big, big, big, {"type": "text", "text": "all three?"}]}]})
    assert "exceeds the context length" in assert_openai_error(r, 400, "context length")["message"]
    server.wait_freed(5)


# ---- a GGUF text model and llama.cpp's mmproj file ----------------------------------------------


def test_gguf_with_mmproj_gives_the_checkpoints_answer(kind, tiny_dir, runner, hf, processor, tmp_path):
    """The text model as llama.cpp's converter writes it (qwen35, qwen3vl, qwen3vlmoe: its vocabulary with the
    vision tokens, rope.dimension_sections) beside the tower as an mmproj file (qwen3vl_merger,
    with Qwen3-VL's DeepStack mergers): the same first-step logprobs as the checkpoint, and
    transformers' tokens through the engine."""
    from safetensors.torch import load_file

    from tests.e2e.test_linear_attention import write_gguf
    from unison import Engine
    from unison.bench.qwen_tower import write_mmproj

    text = write_gguf(tiny_dir, kind, tmp_path / "text.gguf",
                      extra_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    tower = {k: v for f in tiny_dir.glob("*.safetensors") for k, v in load_file(f).items()
             if k.startswith("model.visual.")}
    size = PREPROCESSOR["size"]
    mmproj = write_mmproj(tower, runner.vision.tower.cfg, tmp_path / "mmproj.gguf",
                          mean=PREPROCESSOR["image_mean"], std=PREPROCESSOR["image_std"], float16=False,
                          pixels=(size["shortest_edge"], size["longest_edge"]))
    pic = PICTURES[1]
    ids, placed = prompt_ids(runner, chat(PROMPTS[1]), [pic])
    from_gguf = ModelRunner(text, quantization="none", num_blocks=64, state_slots=2, mmproj=str(mmproj))
    import msgspec

    spec = from_gguf.vision.spec  # (the file keeps mean and std in float32, as the frontend uses them)
    assert np.array_equal(np.float32(spec.mean), np.float32(runner.vision.spec.mean))
    assert msgspec.structs.replace(spec, mean=runner.vision.spec.mean, std=runner.vision.spec.std) \
        == runner.vision.spec
    _, first = greedy(from_gguf, ids, placed, 1)
    _, want = greedy(runner, ids, placed, 1)
    assert list(first) == list(want) and max(abs(first[t] - want[t]) for t in first) < 1e-4
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(processor, ids, [pic]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    with Engine(model_path=str(text), mmproj=str(mmproj), quantization="none") as engine:
        out = engine.generate(chat(PROMPTS[1]), GREEDY, image_data=png(pic))
    assert out["output_ids"] == ref.tolist() and out["meta_info"]["prompt_tokens"] == len(ids)
