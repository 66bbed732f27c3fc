"""Images in: a tiny random Gemma 3 with its vision tower (Gemma3ForConditionalGeneration made
with transformers, Gemma 3's tokenizer and chat template), against transformers fed the same
pixels through its own processor: the frontend's pixels bit for bit, greedy tokens and
first-step logprobs, image tokens seeing their whole image (inside and past a sliding window),
chunked prefill, batching, the prefix cache and the encoder's cache, and every API's refusals."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from tests.models import gemma3_gguf
from tests.utils import HTTP, top_logprobs
from unison.bench.vision import GEMMA3_TEMPLATE as TEMPLATE
from unison.frontend import images
from unison.model.kernels import cpu_kernels
from unison.model.runner import BatchItem, ModelRunner
from unison.model.weights.loader import resolve_model_dir

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="images run on the C attention kernel")

WINDOW = 48  # the sliding layer's: prompts run past it, so an image's rows test its edge
TOKENS = 16  # per image
PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                "do_resize": True, "size": {"height": 64, "width": 64}, "resample": 2, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": None, "do_pan_and_scan": None,
                "image_seq_length": TOKENS}


def tiny_gemma3_vision(path: Path) -> Path:
    """Six text layers (five sliding, one global: Gemma 3's pattern, which a GGUF implies) and a
    two-layer SigLIP of seeded random weights
    (widened so that every image pixel matters), with Gemma 3's tokenizer (from the 270M GGUF,
    plus its <image_soft_token> at 262144) and chat template, saved by transformers."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        vocab_size=262_208, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, max_position_embeddings=2048)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=64, patch_size=8,
                                             vision_use_head=False)  # (as Gemma 3's)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.ndim > 1 else 0.5)
    hf.save_pretrained(path)
    source = resolve_model_dir(gemma3_gguf())
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image_soft_token>", special=True, normalized=False)])
    assert tok.token_to_id("<image_soft_token>") == 262_144
    tok.save(str(path / "tokenizer.json"))
    special = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
               "image_token": "<image_soft_token>"}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": TEMPLATE, "extra_special_tokens": special, **special}))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    shutil.copy(source / "generation_config.json", path / "generation_config.json")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision") / "tiny")


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(model_dir):
    import transformers

    return transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(**PREPROCESSOR),
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir), chat_template=TEMPLATE,
        image_seq_length=TOKENS)


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return PIL.Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, quantization="none", num_blocks=64)


# ---- the frontend's pixels ------------------------------------------------------------------------


@pytest.mark.parametrize("size,mode", [((64, 64), "RGB"), ((100, 37), "RGB"), ((33, 90), "RGBA"),
                                       ((640, 480), "RGB"), ((7, 5), "L"), ((1, 300), "RGB")])
def test_pixels_equal_the_hf_processor_bit_for_bit(runner, size, mode):
    import transformers

    image = picture(*size, mode=mode)
    assert runner.vision is not None
    limits = images.ImageLimits(1 << 30, 1 << 30)
    read = images.read(images.ImageSource(png(image), "image"), limits)
    ours = images.prepare(read, runner.vision.spec).pixels
    # (do_convert_rgb: null, as published, leaves an RGBA or grayscale image unconverted, and then
    # transformers' normalize refuses it; the frontend converts every image, as the class default)
    reference = transformers.Gemma3ImageProcessorPil(**{**PREPROCESSOR, "do_convert_rgb": True})
    theirs = reference(image, return_tensors="np")["pixel_values"][0]
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


# ---- the model against transformers --------------------------------------------------------------


def hf_inputs(processor, text: str, pictures: list, add_special_tokens: bool = True):
    """What transformers' processor makes of a prompt text (its image markers) and pictures."""
    return processor(text=text, images=pictures or None, return_tensors="pt",
                     add_special_tokens=add_special_tokens)


def our_item(runner, ids: list[int], pictures: list, logits_start: int | None = None) -> BatchItem:
    spec = runner.vision.spec
    _, placed = images.place(ids, [images.prepare(p, spec) for p in pictures], spec, "prompt")
    table = list(range(-(-len(ids) // runner.block_size)))
    return BatchItem(ids, 0, table, len(ids) - 1 if logits_start is None else logits_start, images=placed)


TEXTS = ["<bos>Describe <start_of_image> in one word.",
         "<bos>" + "word " * 60 + "then <start_of_image> and <start_of_image> twice.",  # past the window
         "<bos>Two: <start_of_image><start_of_image> end"]
PICTURES = [[picture(80, 60, seed=1)], [picture(64, 64, seed=2), picture(30, 90, seed=3)],
            [picture(50, 50, seed=4), picture(50, 50, seed=5)]]


@pytest.mark.parametrize("case", range(len(TEXTS)))
def test_prompt_logits_equal_transformers(runner, hf, processor, case):
    """Every prompt row's top-5 logprobs within 1e-3 of transformers' (float32), an image's rows
    seeing the whole image (the second prompt puts its images past the sliding window)."""
    inputs = hf_inputs(processor, TEXTS[case], PICTURES[case])
    ids = inputs["input_ids"][0].tolist()
    runner.attention.k_cache.zero_()
    ours = runner.forward([our_item(runner, ids, PICTURES[case], logits_start=0)])
    with torch.no_grad():
        theirs = hf(**inputs).logits[0]
    for row in range(len(ids)):
        a, b = top_logprobs(ours[row: row + 1])[0], top_logprobs(theirs[row: row + 1])[0]
        assert list(a) == list(b), f"row {row}"
        assert max(abs(a[t] - b[t]) for t in a) < 1e-3, f"row {row}"


def test_greedy_tokens_equal_transformers(model_dir, hf, processor):
    from tests.utils import greedy

    runner = ModelRunner(model_dir, quantization="none", num_blocks=64)
    for text, pictures in zip(TEXTS, PICTURES):
        inputs = hf_inputs(processor, text, pictures)
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            ref = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        item = our_item(runner, ids, pictures)
        got = greedy_with_images(runner, item, 8)
        assert got == ref
    assert greedy  # (the text-only helper's shape, for the reader)


def greedy_with_images(runner: ModelRunner, item: BatchItem, new_tokens: int) -> list[int]:
    """Prefill `item` whole, then decode greedily one token at a time."""
    ids, out = list(item.token_ids), []
    logits = runner.forward([item])
    for _ in range(new_tokens):
        out.append(int(logits[-1].argmax()))
        ids.append(out[-1])
        table = list(range(-(-len(ids) // runner.block_size)))
        logits = runner.forward([BatchItem([out[-1]], len(ids) - 1, table, 0, images=item.images)])
    return out


# ---- the Python API (sglang.Engine's image_data) ------------------------------------------------

PROMPT = "<bos><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def engine(model_dir):
    from unison import Engine

    with Engine(model_path=str(model_dir), quantization="none", chunked_prefill_size=64) as e:
        yield e


def test_engine_image_data_gives_transformers_tokens(engine, hf, processor, tmp_path):
    """One picture, as bytes, a data URL, base64 text, a PIL image and a file: transformers'
    greedy tokens; the prompt's tokens count the image's placeholders."""
    pic = picture(120, 90, seed=7)
    inputs = hf_inputs(processor, PROMPT, [pic])
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, n:].tolist()
    (tmp_path / "pic.png").write_bytes(png(pic))
    path = str(tmp_path / "pic.png")
    for given in (png(pic), data_url(pic), base64.b64encode(png(pic)).decode(), pic, path):
        out = engine.generate(PROMPT, GREEDY, image_data=given)
        assert out["output_ids"] == ref
        assert out["meta_info"]["prompt_tokens"] == n


def test_image_requests_are_bit_identical_alone_and_batched(engine):
    """An image request's output alone equals its output beside text prompts and other images,
    and with the prompt chunked at 8 tokens (an image is never split: its 16 rows go together)."""
    pics = [picture(70, 40, seed=s) for s in range(3)]
    logprobs = {"return_logprob": True, "top_logprobs_num": 5}

    def seen(out: dict) -> tuple:  # tokens and every step's top-5 logprobs, as floats
        return tuple(out["output_ids"]), str(out["meta_info"]["output_top_logprobs"])

    alone = [seen(engine.generate(PROMPT, GREEDY, image_data=p, **logprobs)) for p in pics]
    batch = engine.generate([PROMPT, "<bos>plain text", PROMPT, PROMPT], GREEDY,
                            image_data=[pics[0], None, pics[1], [pics[2]]], **logprobs)
    assert [seen(batch[i]) for i in (0, 2, 3)] == alone
    assert len({a[1] for a in alone}) == 3  # the pictures matter


def test_chunked_prefill_never_splits_an_image(engine, model_dir):
    from unison import Engine

    pic = picture(64, 48, seed=9)
    engine.flush_cache()
    want = engine.generate(PROMPT, GREEDY, image_data=pic)["output_ids"]  # one chunk of 64
    with Engine(model_path=str(model_dir), quantization="none", chunked_prefill_size=8) as chunked:
        assert chunked.generate(PROMPT, GREEDY, image_data=pic)["output_ids"] == want


def test_prefix_cache_knows_a_picture_by_its_pixels(engine, model_dir):
    """The same picture again is a hit through its image; another picture misses from its
    image's first token on (its placeholders are the same token ids)."""
    engine.flush_cache()
    first, other = picture(90, 90, seed=11), picture(90, 90, seed=12)
    engine.generate(PROMPT, GREEDY, image_data=first)
    again = engine.generate(PROMPT, GREEDY, image_data=first)["meta_info"]["cached_tokens"]
    from unison.frontend.text.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(PROMPT.replace("<start_of_image>", "\n\n<start_of_image>"))
    image_start = ids.index(255999) + 1
    assert again >= (image_start + TOKENS) // 16 * 16
    assert engine.generate(PROMPT, GREEDY, image_data=other)["meta_info"]["cached_tokens"] <= image_start


@pytest.mark.parametrize("given,fragment", [
    (b"not an image", "not an image in a supported format"),
    ("data:image/png;base64,@@@", "not base64"),
    ("https://example.com/cat.png", "image URLs are not fetched"),
])
def test_engine_refuses_bad_images_by_field(engine, given, fragment):
    from unison.errors import InvalidParam

    with pytest.raises(InvalidParam, match=fragment) as e:
        engine.generate(PROMPT, GREEDY, image_data=given)
    assert e.value.field == "image_data"


def test_engine_refuses_markers_that_do_not_fit(engine):
    from unison.errors import InvalidParam

    with pytest.raises(InvalidParam, match="1 image marker"):
        engine.generate(PROMPT, GREEDY, image_data=[picture(9, 9), picture(9, 9)])
    with pytest.raises(InvalidParam, match="placeholders"):  # placeholders given with no image
        engine.generate(PROMPT.replace("<start_of_image>", "<image_soft_token>"), GREEDY)


# ---- over HTTP: every API ------------------------------------------------------------------------

CONTEXT = 96  # room for four images (20 tokens each), not five


@pytest.fixture(scope="module")
def server(model_dir):
    from tests.serving import serve

    yield from serve("vision", str(model_dir), "--served-model-name", "m", "--quantization", "none",
                     "--context-length", str(CONTEXT), "--max-image-pixels", "20000",
                     "--image-url-hosts", "127.0.0.1", "--image-fetch-timeout-s", "2")


def ask(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_chat_gives_transformers_answer(url: str, hf, processor, pic, **processor_options) -> None:
    """An OpenAI chat with `pic` and "What is this?" answers as transformers' processor (its
    `processor_options`) and model do, and its usage counts the image's placeholders."""
    import openai

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    # (no special tokens added: the template wrote <bos>)
    inputs = processor(text=text, images=[pic], return_tensors="pt", add_special_tokens=False,
                       **processor_options)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, n:]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model="m", messages=ask(image_part(data_url(pic))),
                                         temperature=0, max_tokens=8)
    assert out.choices[0].message.content == processor.tokenizer.decode(ref, skip_special_tokens=True)
    assert out.usage.prompt_tokens == n
    tokenized = HTTP.post(url + "/tokenize", json={"model": "m", "messages": ask(image_part(data_url(pic)))})
    assert tokenized.json()["tokens"] == inputs["input_ids"][0].tolist()  # the crops counted, as queued


def test_openai_chat_with_an_image_gives_transformers_answer(server, hf, processor):
    assert_chat_gives_transformers_answer(server.url, hf, processor, picture(100, 75, seed=21))


def test_every_api_sees_the_same_picture(server):
    """Anthropic's image block, Ollama's images, the Responses API's input_image: the chat
    completion's answer for the same picture."""
    pic = picture(60, 80, seed=22)
    b64 = base64.b64encode(png(pic)).decode()
    chat = server.post("/v1/chat/completions", {"model": "m", "messages": ask(image_part(data_url(pic))),
                                                "temperature": 0, "max_tokens": 8}).json()
    want = chat["choices"][0]["message"]["content"]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    anthropic = server.post("/v1/messages", {"model": "m", "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}]}).json()
    assert anthropic["content"][0]["text"] == want
    ollama = server.post("/api/chat", {
        "model": "m", "stream": False, "options": {"temperature": 0, "num_predict": 8},
        "messages": [{"role": "user", "content": "What is this?", "images": [b64]}]})
    assert ollama.json()["message"]["content"] == want
    responses = server.post("/v1/responses", {
        "model": "m", "temperature": 0, "max_output_tokens": 8,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(pic)},
                                               {"type": "input_text", "text": "What is this?"}]}]}).json()
    assert responses["output"][-1]["content"][0]["text"] == want


def bomb() -> bytes:
    """A small PNG whose header claims 40,000 x 40,000 pixels (its CRC fixed): refused before decoding."""
    import struct
    import zlib

    data = bytearray(png(picture(8, 8)))
    data[16:24] = struct.pack(">II", 40_000, 40_000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def tiff() -> bytes:
    out = io.BytesIO()
    picture(8, 8).save(out, format="TIFF")
    return out.getvalue()


FIELD = "messages[0].content[0].image_url"


@pytest.mark.parametrize("url,fragment", [
    ("data:image/png;base64," + base64.b64encode(b"garbage").decode(), "not an image in a supported format"),
    ("data:image/tiff;base64," + base64.b64encode(tiff()).decode(), "not an image in a supported format"),
    ("data:image/png;base64,%%%", "not base64"),
    ("https://example.com/cat.png", "image URLs from 'example.com' are not fetched"),
    ("data:image/png;base64," + base64.b64encode(bomb()).decode(), "over max_image_pixels"),
])
def test_bad_images_are_400s_naming_the_part(server, url, fragment):
    from tests.serving import assert_openai_error

    r = server.post("/v1/chat/completions", {"model": "m", "messages": ask(image_part(url)), "max_tokens": 4})
    assert assert_openai_error(r, 400, fragment)["param"] == FIELD


def test_too_big_and_too_many_images_are_refused_before_anything_is_queued(server):
    from tests.serving import assert_openai_error

    r = server.post("/v1/chat/completions", {"model": "m", "max_tokens": 4,
                                             "messages": ask(image_part(data_url(picture(200, 200))))})
    error = assert_openai_error(r, 400, "200x200 pixels, over max_image_pixels (20000)")
    assert error["param"] == FIELD
    five = [image_part(data_url(picture(20, 20, seed=s))) for s in range(5)]
    r = server.post("/v1/chat/completions", {"model": "m", "messages": ask(*five), "max_tokens": 4})
    error = assert_openai_error(r, 400, f"exceeds the context length ({CONTEXT})")
    assert error["param"] == "messages"
    r = server.post("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].content[0].source")
    r = server.post("/api/chat", {"model": "m", "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [base64.b64encode(tiff()).decode()]}]})
    assert r.status_code == 400 and "messages[0].images[0]" in r.json()["error"]
    server.wait_freed(5)


@contextlib.contextmanager
def image_host(body: bytes):
    """A local HTTP server: /cat.png is `body`; /huge.png declares a gigabyte; /slow.png answers
    only once the block ends; /moved.png redirects to /cat.png; anything else is a 404."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    done = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            if self.path not in ("/cat.png", "/huge.png", "/slow.png"):
                self.send_error(404)
                return
            if self.path == "/slow.png":
                done.wait()
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(1 << 30 if self.path == "/huge.png" else len(body)))
            self.end_headers()
            if self.path != "/huge.png":
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="image-host")
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        done.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_image_urls_are_fetched_from_the_hosts_allowed_within_the_limits(server):
    """--image-url-hosts 127.0.0.1: a picture's URL there gives the data URL's answer, through the
    chat route, Anthropic's url source and SGLang's /generate; another host, a 404, a redirect
    (not followed), a declared size over max_image_bytes and a fetch past image_fetch_timeout_s
    are 400s naming the part, and nothing is queued."""
    from tests.serving import assert_openai_error

    pic = picture(50, 70, seed=23)

    def chat(url: str):
        return server.post("/v1/chat/completions", {"model": "m", "messages": ask(image_part(url)),
                                                    "temperature": 0, "max_tokens": 8})

    want = chat(data_url(pic)).json()["choices"][0]["message"]["content"]
    with image_host(png(pic)) as host:
        assert chat(host + "/cat.png").json()["choices"][0]["message"]["content"] == want
        block = {"type": "image", "source": {"type": "url", "url": host + "/cat.png"}}  # Anthropic's
        messages = [{"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}]
        anthropic = server.post("/v1/messages", {"model": "m", "max_tokens": 8, "temperature": 0,
                                                 "messages": messages}).json()
        assert anthropic["content"][0]["text"] == want
        r = server.post("/generate", {"text": PROMPT, "image_data": host + "/cat.png",
                                      "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] > TOKENS
        for url, fragment in [(host.replace("127.0.0.1", "localhost") + "/cat.png",
                               "image URLs from 'localhost' are not fetched"),
                              (host + "/missing.png", "fetching the image gave HTTP 404"),
                              (host + "/moved.png", "fetching the image gave HTTP 302"),  # not followed
                              (host + "/huge.png", "over max_image_bytes"),
                              (host + "/slow.png", "took over image_fetch_timeout_s (2 s)")]:
            assert assert_openai_error(chat(url), 400, fragment)["param"] == FIELD, url
    server.wait_freed(5)


def test_http_clients_never_name_server_files(server, tmp_path):
    """The Python API reads its caller's files; over HTTP (SGLang's /generate takes image_data
    too) a path is not base64, and the server never opens it."""
    (tmp_path / "pic.png").write_bytes(png(picture(20, 20)))
    r = server.post("/generate", {"text": PROMPT, "image_data": str(tmp_path / "pic.png"),
                                  "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "image_data: not base64 image data" in r.text
    r = server.post("/generate", {"text": PROMPT, "image_data": data_url(picture(20, 20)),
                                  "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] > TOKENS


def test_a_text_only_model_refuses_images_by_field():
    from tests.serving import assert_openai_error, serve

    for text_only in serve("text only"):  # the embedded model
        r = text_only.post("/v1/chat/completions", {"messages": ask(image_part(data_url(picture(8, 8)))),
                                                    "max_tokens": 4})
        assert assert_openai_error(r, 400, "takes no images")["param"] == FIELD


def test_compiled_decoder_equals_the_python_forward_with_images(model_dir):
    """Quantized, a step is one C call (csrc/decoder.c): the image rows' embeddings and their
    keys ahead go in there too, the Python forward's bits."""
    runner = ModelRunner(model_dir, quantization="int8", num_blocks=64)
    assert runner._compiled is not None
    item = our_item(runner, *hf_ids_and_pictures(runner, 1), logits_start=0)
    compiled = runner.forward([item])
    runner._compiled = None
    assert torch.equal(runner.forward([item]), compiled)


def test_int8_kv_beside_images_gives_the_same_bits_however_batched_or_chunked(model_dir):
    """The int8 cache (each query's own block read as float16) beside image rows that see their
    whole image: a prompt's last logits are the same whole, in chunks cut at its images' edges and
    mid-text, and beside another image prompt; the compiled decoder's are the Python forward's;
    and they stay near the float16 cache's."""
    runner = ModelRunner(model_dir, quantization="int8", kv_cache_dtype="int8", num_blocks=64)
    fp16 = ModelRunner(model_dir, quantization="int8", num_blocks=64)
    assert runner.kv_dtype == torch.int8 and runner._compiled is not None
    spec, bs = runner.vision.spec, runner.block_size
    ids, pics = hf_ids_and_pictures(runner, 1)  # two pictures, past the sliding window
    _, placed = images.place(ids, [images.prepare(p, spec) for p in pics], spec, "prompt")
    n, width = len(ids), -(-len(ids) // bs)
    tables = iter(list(range(i * width, (i + 1) * width)) for i in range(64 // width))

    def whole(r: ModelRunner) -> torch.Tensor:
        return r.forward([BatchItem(ids, 0, next(tables), n - 1, images=placed)])

    want = whole(runner)
    cuts = sorted({0, n, 37} | {i.offset for i in placed} | {i.offset + i.tokens for i in placed})
    table = next(tables)
    for a, b in zip(cuts, cuts[1:]):
        last = runner.forward([BatchItem(ids[a:b], a, table, n - 1 - a if b == n else b - a, images=placed)])
    assert torch.equal(last, want)
    other_ids, other_pics = hf_ids_and_pictures(runner, 2)
    _, other = images.place(other_ids, [images.prepare(p, spec) for p in other_pics], spec, "prompt")
    both = runner.forward([BatchItem(other_ids, 0, next(tables), len(other_ids) - 1, images=other),
                           BatchItem(ids, 0, next(tables), n - 1, images=placed)])
    assert torch.equal(both[1:], want)
    runner._compiled = None
    assert torch.equal(whole(runner), want)
    near = (torch.log_softmax(want, -1) - torch.log_softmax(whole(fp16), -1)).abs().max()
    assert near < 0.05, near


def hf_ids_and_pictures(runner: ModelRunner, case: int) -> tuple[list[int], list]:
    """TEXTS[case]'s ids as the engine makes them (markers expanded) and its pictures."""
    from unison.frontend.text.tokenizer import Tokenizer

    spec = runner.vision.spec
    text = images.expand(TEXTS[case], [0] * len(PICTURES[case]), spec, "prompt")
    return Tokenizer.from_dir(runner.model_dir).encode(text, add_special_tokens=False), PICTURES[case]


# ---- a GGUF model and llama.cpp's mmproj file ---------------------------------------------------


def write_text_gguf(model_dir: Path, out: Path) -> Path:
    """The tiny model's text part as llama.cpp's converter writes a gemma3 GGUF (norms as 1 + w,
    F32), with Gemma 3's tokenizer from the 270M GGUF grown to the 4B's 262,208 tokens
    (<image_soft_token> at 262,144, as the published files have it)."""
    from gguf import GGUFWriter

    from unison.bench.model import copy_fields
    from unison.bench.vision import image_tokens
    from unison.model.weights.gguf_header import read_fields
    from unison.model.weights.sources import SafetensorsWeights

    cfg = json.loads((model_dir / "config.json").read_text())["text_config"]
    src, w = SafetensorsWeights(model_dir), GGUFWriter(out, "gemma3")
    for key, value in [("context_length", 2048), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]),
                       ("feed_forward_length", cfg["intermediate_size"]),
                       ("head_count", cfg["num_attention_heads"]),
                       ("head_count_kv", cfg["num_key_value_heads"]),
                       ("key_length", cfg["head_dim"]), ("value_length", cfg["head_dim"]),
                       ("layer_norm_rms_eps", cfg["rms_norm_eps"]), ("rope_freq_base", 1e6),
                       ("sliding_window", cfg["sliding_window"])]:
        getattr(w, f"add_{key}")(value)
    copy_fields(w, read_fields(gemma3_gguf(), "tokenizer."), extend=image_tokens(cfg["vocab_size"] - 262_144))
    roles = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name in sorted(src.names()):
        if not name.startswith("language_model.model."):
            continue
        rest, t = name.removeprefix("language_model.model."), src.float(name).numpy()
        if rest == "embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif rest == "norm.weight":
            w.add_tensor("output_norm.weight", t + 1)
        else:
            layer, role = rest.removeprefix("layers.").split(".", 1)
            role = role.removesuffix(".weight")
            w.add_tensor(f"blk.{layer}.{roles[role]}.weight", t + 1 if "norm" in role else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tower_tensors(model_dir: Path) -> dict:
    """The tiny model's tower and projector under the published checkpoints' names."""
    from unison.model.weights.sources import SafetensorsWeights

    src = SafetensorsWeights(model_dir)
    return {name.replace("vision_tower.", "vision_tower.vision_model.", 1): src.float(name)
            for name in src.names() if name.startswith(("vision_tower.", "multi_modal_projector."))}


@pytest.fixture(scope="module")
def gguf_files(model_dir, tmp_path_factory) -> tuple[Path, Path]:
    from unison.bench.vision import write_mmproj
    from unison.model.vision.siglip import VisionConfig

    out = tmp_path_factory.mktemp("gemma3-gguf")
    cfg = VisionConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return (write_text_gguf(model_dir, out / "text.gguf"),
            write_mmproj(tower_tensors(model_dir), cfg, out / "mmproj.gguf", float16=False))


def test_mmproj_refusals_name_the_file(gguf_files, model_dir, tmp_path):
    from unison.bench.vision import random_tower, write_mmproj
    from unison.model.vision.siglip import VisionConfig

    _, mmproj = gguf_files
    with pytest.raises(ValueError, match="mmproj: a llama model takes no vision tower"):
        ModelRunner(None, mmproj=str(mmproj), num_blocks=8)  # the embedded model: a Llama
    other = VisionConfig(32, 64, 1, 2, 64, 8, 1e-6, 48, 16, 262_144, 255_999, 256_000)
    wrong = write_mmproj(random_tower(other), other, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="projection_dim 48 is not the text model's hidden size 64"):
        ModelRunner(model_dir, mmproj=str(wrong), quantization="none", num_blocks=8)


def test_the_encoder_runs_once_per_picture(model_dir):
    """A picture's embeddings are kept by its hash: a second prompt with it, or a later chunk
    of the same prompt, does not run the tower again; another picture does."""
    runner = ModelRunner(model_dir, quantization="none", num_blocks=64)
    ids, pictures = hf_ids_and_pictures(runner, 0)
    runner.forward([our_item(runner, ids, pictures)])
    runner.forward([our_item(runner, ids, pictures)])
    assert runner.vision.encoded == 1
    runner.forward([our_item(runner, ids, [picture(80, 60, seed=99)])])
    assert runner.vision.encoded == 2


def test_a_gguf_with_its_mmproj_sees_pictures_as_the_checkpoint_does(gguf_files, engine, monkeypatch,
                                                                    tmp_path):
    """The same weights as a GGUF and an mmproj file (float32, as llama.cpp's converter writes
    them with --outtype f32), in a repository as llama.cpp's -hf takes them (the mmproj file
    beside the model: --mmproj is set from it): the Hugging Face directory's tokens, and its
    logprobs within 1e-3 (the file keeps the projector's norm as 1 + w, which float32 does not
    give back exactly)."""
    from tests.hub import StandInHub, point_at
    from unison import Engine

    text, mmproj = gguf_files
    logprobs = {"return_logprob": True, "top_logprobs_num": 5}
    pics = [picture(77, 55, seed=31), picture(40, 90, seed=32)]
    want = [engine.generate(PROMPT, GREEDY, image_data=p, **logprobs) for p in pics]
    with StandInHub() as hub:
        point_at(monkeypatch, hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        hub.add("org/tiny-gemma3-vision-GGUF", {"tiny-F32.gguf": text.read_bytes(),
                                                "mmproj-tiny-F32.gguf": mmproj.read_bytes()})
        with Engine(model_path="org/tiny-gemma3-vision-GGUF:F32", download_dir=str(tmp_path / "cache"),
                    quantization="none") as named:
            assert Path(named.get_server_info()["mmproj"]).name == "mmproj-tiny-F32.gguf"
            got = [named.generate(PROMPT, GREEDY, image_data=p, **logprobs) for p in pics]
    for a, b in zip(got, want):
        assert a["output_ids"] == b["output_ids"]
        for x, y in zip(a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]):
            assert [t for _, t, _ in x] == [t for _, t, _ in y]
            assert max(abs(p - q) for (p, _, _), (q, _, _) in zip(x, y)) < 1e-3


# ---- pan-and-scan (opt-in, as in transformers) --------------------------------------------------

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 3,
                "pan_and_scan_min_ratio_to_activate": 1.2}


@pytest.fixture(scope="module")
def pas_dir(model_dir, tmp_path_factory) -> Path:
    """The tiny Gemma 3 with its processor's pan-and-scan turned on."""
    out = tmp_path_factory.mktemp("gemma3-pan-and-scan") / "tiny"
    shutil.copytree(model_dir, out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR | PAN_AND_SCAN))
    return out


@pytest.mark.parametrize("size", [(200, 60), (60, 130), (100, 70), (70, 64), (40, 500), (300, 20)])
def test_pan_and_scan_crops_equal_the_hf_processor_bit_for_bit(pas_dir, size):
    """The picture and each crop (landscape, portrait, just past the ratio, under it, more crops
    than allowed, crops at the minimum size), and how many crops."""
    import transformers

    from unison.model.vision.encoder import image_spec
    from unison.model.vision.siglip import VisionConfig

    spec = image_spec(pas_dir, VisionConfig.from_hf(json.loads((pas_dir / "config.json").read_text())))
    image = picture(*size, seed=sum(size))
    read = images.read(images.ImageSource(png(image), "image"), images.ImageLimits(1 << 30, 1 << 30))
    ours = images.prepare(read, spec)
    reference = transformers.Gemma3ImageProcessorPil(**PREPROCESSOR | PAN_AND_SCAN | {"do_convert_rgb": True})
    theirs = reference(image, return_tensors="np")
    assert len(ours.crops) == theirs["num_crops"][0] and (len(ours.crops) > 0) == (size != (70, 64))
    got = np.stack([view.pixels for view in ours.views()])
    assert got.shape == theirs["pixel_values"].shape
    assert np.array_equal(got.view(np.uint32), theirs["pixel_values"].view(np.uint32))


def pas_inputs(processor, text: str, pictures: list, add_special_tokens: bool = True):
    return processor(text=text, images=pictures, return_tensors="pt", add_special_tokens=add_special_tokens,
                     **PAN_AND_SCAN)


def test_pan_and_scan_gives_transformers_tokens_through_the_engine_and_chat(pas_dir, hf, processor):
    """A wide picture's crops: the prompt (its words and a run per crop) and greedy tokens of
    transformers' processor and model, through Engine.generate and an OpenAI chat (whose text
    the worker expands once the picture is read)."""
    from tests.serving import serve
    from unison import Engine

    pic = picture(150, 50, seed=31)
    inputs = pas_inputs(processor, PROMPT, [pic])
    n = inputs["input_ids"].shape[1]
    assert len(inputs["pixel_values"]) > 1  # (crops were cut)
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, n:].tolist()
    with Engine(model_path=str(pas_dir), quantization="none") as engine:
        out = engine.generate(PROMPT, GREEDY, image_data=pic)
    assert out["output_ids"] == ref and out["meta_info"]["prompt_tokens"] == n
    with contextlib.closing(serve("vision-pas", str(pas_dir), "--served-model-name", "m", "--quantization",
                                  "none")) as started:
        server = next(started)  # (closing it stops the server, whatever the assertions say)
        assert_chat_gives_transformers_answer(server.url, hf, processor, pic, **PAN_AND_SCAN)
