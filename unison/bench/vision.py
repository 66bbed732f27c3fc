"""`unison bench vision`: the vision encoder's time for one 896 x 896 image at Gemma 3 4B's tower
(SigLIP, 27 layers of 1,152, 4,096 patches), random weights, beside llama.cpp's (`llama-mtmd-cli
--mmproj`, its "image slice encoded" / "batch encoding done" time) and transformers' on the same weights.
With a Qwen3.5 text model, Qwen3.5's tower instead (qwen_tower.py).

The mmproj file llama.cpp reads is written here as llama.cpp's converter writes it
(`write_mmproj`: its names, F16 linears, F32 embeddings and norms, the projector's norm as 1 + w):
the converter itself needs the checkpoint's llama.cpp source tree, which is not installed here.
The text model beside it is the Gemma 3 270M GGUF (`--text-model`), its hidden size the
projector's output: the encoder's work does not depend on it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (torch and the model load inside the command: `unison serve` imports this parser)
    import torch

    from unison.model.vision.siglip import VisionConfig

# The published checkpoints' prefixes (unison/model/vision/mmproj.py's, which imports torch)
TOWER, PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."

# Gemma 3 4B's tower (google/gemma-3-4b-it's vision_config), projected to `text_hidden`.
GEMMA3_4B = {"hidden_size": 1152, "intermediate_size": 4304, "num_layers": 27, "num_heads": 16,
             "image_size": 896, "patch_size": 14}


def gemma3_tower(text_hidden: int, layers: int | None = None) -> VisionConfig:
    from unison.model.vision.siglip import VisionConfig

    shape = GEMMA3_4B | ({"num_layers": layers} if layers else {})
    return VisionConfig(**shape, layer_norm_eps=1e-6, text_hidden_size=text_hidden, mm_tokens_per_image=256,
                        image_token_id=262_144, boi_token_id=255_999, eoi_token_id=256_000)


def random_tower(cfg: VisionConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights for `cfg`, under the published checkpoints' names."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d, ff, p, t = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, {}

    def add(name: str, *shape: int, scale: float = 0.02) -> None:
        t[name] = torch.randn(*shape, generator=g) * scale

    add(TOWER + "embeddings.patch_embedding.weight", d, 3, p, p)
    add(TOWER + "embeddings.patch_embedding.bias", d)
    add(TOWER + "embeddings.position_embedding.weight", cfg.patches_per_side ** 2, d)
    for i in range(cfg.num_layers):
        n = f"{TOWER}encoder.layers.{i}."
        for name, rows, cols in [("self_attn.q_proj", d, d), ("self_attn.k_proj", d, d),
                                 ("self_attn.v_proj", d, d), ("self_attn.out_proj", d, d), ("mlp.fc1", ff, d),
                                 ("mlp.fc2", d, ff)]:
            add(f"{n}{name}.weight", rows, cols)
            add(f"{n}{name}.bias", rows)
        for norm in ("layer_norm1", "layer_norm2"):
            add(f"{n}{norm}.weight", d, scale=1.0)
            add(f"{n}{norm}.bias", d)
    add(TOWER + "post_layernorm.weight", d, scale=1.0)
    add(TOWER + "post_layernorm.bias", d)
    add(PROJECTOR + "mm_input_projection_weight", d, cfg.text_hidden_size)
    add(PROJECTOR + "mm_soft_emb_norm.weight", d)
    return t


_GGUF_LAYER = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out",
               "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}


def write_mmproj(tensors: dict[str, torch.Tensor], cfg: VisionConfig, out: Path,
                 mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5),
                 float16: bool = True) -> Path:
    """Gemma 3's tower and projector (`tensors` under the published names) as llama.cpp's
    converter writes an mmproj file (`float16` False: its --outtype f32)."""
    from gguf import GGUFWriter

    w = GGUFWriter(out, "clip")
    w.add_type("mmproj")
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    for key, value in [("image_size", cfg.image_size), ("patch_size", cfg.patch_size),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("block_count", cfg.num_layers), ("projection_dim", cfg.text_hidden_size),
                       ("attention.head_count", cfg.num_heads)]:
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", cfg.layer_norm_eps)
    if cfg.pool != 4:  # patches pooled per token, per side: written where not clip.cpp's default
        w.add_uint32("clip.vision.projector.scale_factor", cfg.pool)
    w.add_array("clip.vision.image_mean", list(mean))
    w.add_array("clip.vision.image_std", list(std))
    for name, tensor in tensors.items():
        if name.startswith(TOWER + "head."):  # SigLIP's pooling head: Gemma 3 reads no pooled output
            continue
        gguf_name, data = _gguf_tensor(name, tensor.float().numpy())
        w.add_tensor(gguf_name, data if float16 else data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_tensor(name: str, data: np.ndarray) -> tuple[str, np.ndarray]:
    """A published name's mmproj name and stored data (the converter's types and its 1 + w)."""
    if name == PROJECTOR + "mm_input_projection_weight":
        return "mm.input_projection.weight", data.astype(np.float16)
    if name == PROJECTOR + "mm_soft_emb_norm.weight":
        return "mm.soft_emb_norm.weight", data + 1
    rest = name.removeprefix(TOWER)
    kind = rest.rpartition(".")[2]
    if rest.startswith("embeddings."):  # forced to F32 by the converter
        stem = "v.patch_embd" if "patch" in rest else "v.position_embd"
        return f"{stem}.{kind}", data
    if rest.startswith("post_layernorm."):
        return f"v.post_ln.{kind}", data
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", rest)
    assert m is not None, name
    return f"v.blk.{m[1]}.{_GGUF_LAYER[m[2]]}.{kind}", data.astype(np.float16) if data.ndim == 2 else data


def timed(call: Callable[[], object], trials: int) -> list[float]:
    """Seconds of each of `trials` calls of `call`, after one to warm up."""
    call()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def our_encoder(cfg: VisionConfig, tensors: dict[str, torch.Tensor],
                dtype: torch.dtype) -> Callable[[], object]:
    """One image through Gemma3Vision."""
    import torch

    from unison.model.vision.siglip import Gemma3Vision
    from unison.model.weights.sources import DictWeights

    tower = Gemma3Vision.load(DictWeights(tensors), cfg, dtype)
    pixels = torch.rand(1, 3, cfg.image_size, cfg.image_size) * 2 - 1
    return lambda: tower(pixels)


def transformers_encoder(cfg: VisionConfig, tensors: dict[str, torch.Tensor]) -> Callable[[], object]:
    """One image through transformers' Gemma 3 tower and projector (float32)."""
    import torch
    import transformers

    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(hidden_size=cfg.text_hidden_size, num_hidden_layers=1,
                                                  vocab_size=262_208),
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, image_size=cfg.image_size,
            patch_size=cfg.patch_size), mm_tokens_per_image=cfg.mm_tokens_per_image)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    state = {k.replace("vision_tower.vision_model.", "model.vision_tower.").replace(
        "multi_modal_projector.", "model.multi_modal_projector."): v for k, v in tensors.items()}
    model.load_state_dict(state, strict=False)
    pixels = torch.rand(1, 3, cfg.image_size, cfg.image_size) * 2 - 1
    return torch.no_grad()(lambda: model.model.get_image_features(pixels))


def llama_cpp_encoder_seconds(cli: str, text_model: Path, mmproj: Path, trials: int,
                              template: str = "gemma") -> list[tuple[float, float]]:
    """(image slice encoded, whole run to the first token) seconds from llama-mtmd-cli, per trial,
    for one 896 x 896 picture (`template`: its --chat-template)."""
    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp:
        image = Path(tmp, "image.png")
        rng = np.random.default_rng(0)
        Image.fromarray(rng.integers(0, 256, (896, 896, 3), dtype=np.uint8)).save(image)
        out = []
        for _ in range(trials):
            start = time.perf_counter()
            run = subprocess.run([cli, "-m", str(text_model), "--mmproj", str(mmproj), "--image", str(image),
                                  "-p", "Describe the image.", "-n", "1", "--temp", "0",
                                  "--chat-template", template], capture_output=True, text=True, timeout=1800)
            total = time.perf_counter() - start
            # (build 11434 says "mtmd batch encoding done in N ms"; older ones "image slice encoded in")
            m = re.search(r"(?:image slice encoded in|batch encoding done in) (\d+) ms",
                          run.stdout + run.stderr)
            if run.returncode != 0 or m is None:
                tail = (run.stdout + run.stderr)[-2000:]
                raise RuntimeError(f"llama-mtmd-cli failed ({run.returncode}):\n{tail}")
            out.append((int(m[1]) / 1000, total))
    return out


def run(text_model: Path, llama_mtmd: str | None, trials: int, layers: int | None, out_dir: Path) -> None:
    import torch

    from unison.model.weights.gguf import hf_config, open_gguf
    from unison.model.weights.gguf_header import MMPROJ_PROJECTORS

    hf = hf_config(open_gguf(text_model))
    text_hidden = int(hf["hidden_size"])
    if MMPROJ_PROJECTORS.get(hf["model_type"]) == "qwen3vl_merger":
        return run_qwen(text_model, text_hidden, llama_mtmd, trials, layers, out_dir)
    cfg = gemma3_tower(text_hidden, layers)
    tensors = random_tower(cfg)
    print(f"tower: {cfg.num_layers} layers of {cfg.hidden_size}, {cfg.patches_per_side ** 2} patches, "
          f"projected to {text_hidden}; {torch.get_num_threads()} threads; {trials} trials, medians")
    rows = []
    for name, dtype in (("unison bf16", torch.bfloat16), ("unison float32", torch.float32)):
        rows.append((name, timed(our_encoder(cfg, tensors, dtype), trials)))
    rows.append(("transformers float32", timed(transformers_encoder(cfg, tensors), trials)))
    if llama_mtmd:
        mmproj = write_mmproj(tensors, cfg, out_dir / "mmproj-gemma3-4b-tower.gguf")
        runs = llama_cpp_encoder_seconds(llama_mtmd, text_model, mmproj, trials)
        rows.append(("llama.cpp (image slice encoded)", [e for e, _ in runs]))
        rows.append(("llama.cpp (whole run, -n 1)", [t for _, t in runs]))
    _print_rows(rows)


def run_qwen(text_model: Path, text_hidden: int, llama_mtmd: str | None, trials: int, layers: int | None,
             out_dir: Path) -> None:
    """run() for a Qwen3.5 text model: Qwen3.5's published tower (qwen_tower.py) beside it."""
    import torch

    from unison.bench import qwen_tower

    cfg = qwen_tower.qwen35_tower(text_hidden, layers)
    tensors = qwen_tower.random_tower(cfg)
    rows, (h, w) = [], qwen_tower.GRID
    print(f"tower: Qwen3.5's, {cfg.depth} blocks of {cfg.hidden_size}, {h * w} patches "
          f"({h * w // 4} tokens), projected to {text_hidden}; {torch.get_num_threads()} threads; "
          f"{trials} trials, medians")
    for name, dtype in (("unison bf16", torch.bfloat16), ("unison float32", torch.float32)):
        rows.append((name, timed(qwen_tower.our_encoder(cfg, tensors, dtype), trials)))
    rows.append(("transformers float32", timed(qwen_tower.transformers_encoder(cfg, tensors), trials)))
    if llama_mtmd:
        mmproj = qwen_tower.write_mmproj(tensors, cfg, out_dir / f"mmproj-qwen3.5-tower-{cfg.depth}.gguf")
        runs = llama_cpp_encoder_seconds(llama_mtmd, text_model, mmproj, trials, template="chatml")
        rows.append(("llama.cpp (image slice encoded)", [e for e, _ in runs]))
        rows.append(("llama.cpp (whole run, -n 1)", [t for _, t in runs]))
    _print_rows(rows)


def _print_rows(rows: list[tuple[str, list[float]]]) -> None:
    base = statistics.median(rows[0][1])
    for name, times in rows:
        med = statistics.median(times)
        print(f"{name:34s} {', '.join(f'{t:.1f}' for t in times)} s  median {med:.1f} s  "
              f"({med / base:.2f}x unison bf16's time)")


# ---- served: time to first token, and several clients at once -----------------------------------


QUESTION = "Describe the image."
# Gemma 3's published chat template (google/gemma-3-4b-it): an image part writes <start_of_image>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}")
IMAGE_VOCAB = 262_208  # the published multimodal Gemma 3 files': <image_soft_token> at 262,144


def image_tokens(extra: int) -> dict[str, list]:
    """The `extra` tokens the multimodal Gemma 3 files add past the 270M's 262,144, as the GGUF
    tokenizer arrays they extend: <image_soft_token> first, the rest unused, all control tokens."""
    tokens = ["<image_soft_token>"] + [f"<unused_image_{i}>" for i in range(extra - 1)]
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * extra,
            "tokenizer.ggml.token_type": [3] * extra}  # 3: control


def grown_gemma3(text_model: Path, out: Path) -> Path:
    """A copy of the Gemma 3 text GGUF `text_model` (the 270M's 262,144 tokens) grown to the
    multimodal files' vocabulary (<image_soft_token> at 262,144, the rest unused) with zero
    embedding rows for the new tokens, and the instruct models' chat template where it has none:
    a text model that takes pictures, for the served figures."""
    from gguf import GGUFWriter

    from unison.bench.model import copy_fields, write_grown_tensors
    from unison.model.weights.gguf_header import read_fields

    fields = read_fields(text_model)
    writer = GGUFWriter(out, fields.pop("general.architecture").value)  # (the writer's own field)
    extra = IMAGE_VOCAB - len(fields["tokenizer.ggml.tokens"].value)
    if "tokenizer.chat_template" not in fields:  # (a base model's file: the instruct one's)
        writer.add_chat_template(GEMMA3_TEMPLATE)
    copy_fields(writer, fields, extend=image_tokens(extra))
    return write_grown_tensors(writer, text_model, extra, out)


def _picture_url(seed: int) -> str:
    """A different 896 x 896 picture per seed (a repeated one would hit the encoder's cache), PNG."""
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (896, 896, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _ask(url: str, seed: int) -> float:
    """Seconds until the one-token answer to QUESTION about picture `seed`: the TTFT."""
    import httpx

    content = [{"type": "image_url", "image_url": {"url": _picture_url(seed)}},
               {"type": "text", "text": QUESTION}]
    body = {"model": "m", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    start = time.perf_counter()
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    if reply.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text[:500]}")
    return time.perf_counter() - start


def served(text_model: Path, mmproj: Path, clients: int, trials: int, llama_server: str | None) -> None:
    """TTFT of one picture and QUESTION through `unison serve` (and llama-server --mmproj on the same
    files, the same request), then `clients` different pictures at once through `clients` HTTP
    workers: their TTFTs, and the core's and the workers' CPU over the wall (whether the frontends'
    preparing of pictures ever leaves the core waiting)."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from unison.bench.local_server import attached, proc_cpu_seconds, serving

    ours = [sys.executable, "-m", "unison.cli", "serve", "--model-path", str(text_model), "--mmproj",
            str(mmproj), "--served-model-name", "m", "--tokenizer-worker-num", str(clients),
            "--log-level", "error"]
    servers = [("unison", ours, "/v1/models")]
    if llama_server:
        servers.append(("llama-server", [llama_server, "-m", str(text_model), "--mmproj", str(mmproj),
                                         "-c", "4096", "--host", "127.0.0.1"], "/health"))
    ttft: dict[str, list[float]] = {}
    for name, cmd, ready in servers:
        with serving(cmd, f"bench-vision-{name}", ready_path=ready, timeout=600) as url:
            _ask(url, 999)  # warm up
            ttft[name] = [_ask(url, seed) for seed in range(trials)]
            if name != "unison":
                continue
            info = attached(url, clients)
            pids = [fe.pid for fe in info.frontends]
            core0, fe0 = proc_cpu_seconds(info.core_pid), sum(map(proc_cpu_seconds, pids))
            t0 = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                together = sorted(pool.map(lambda seed: _ask(url, seed), range(100, 100 + clients)))
            wall = time.perf_counter() - t0
            core, fe = proc_cpu_seconds(info.core_pid) - core0, sum(map(proc_cpu_seconds, pids)) - fe0
    print(f"TTFT of one 896x896 picture and {QUESTION!r}, {trials} trials (a new picture each), s:")
    for name, times in ttft.items():
        print(f"  {name:14s} {', '.join(f'{t:.2f}' for t in times)}  median {statistics.median(times):.2f}")
    if "llama-server" in ttft:
        print(f"  ratio of medians (llama-server / unison): "
              f"{statistics.median(ttft['llama-server']) / statistics.median(ttft['unison']):.2f}x")
    print(f"{clients} clients, a different picture each, at once through {clients} HTTP workers: TTFTs "
          f"{', '.join(f'{t:.2f}' for t in together)} s over {wall:.2f} s; CPU over the wall: the core "
          f"{core / wall:.2f}, the workers {fe / wall:.2f} in all ({os.cpu_count()} cores here)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("vision", help="the vision encoder for one 896x896 image at Gemma 3 4B's tower (or "
                                      "Qwen3.5's), beside llama.cpp's (llama-mtmd-cli) and transformers'")
    p.add_argument("--text-model", default=None,
                   help="the GGUF text model beside the tower (default: the Gemma 3 270M test model); a "
                        "Qwen3.5 one (unison bench make-model --size qwen3.5-35b-a3b) times Qwen3.5's tower")
    p.add_argument("--llama-mtmd", default=None, help="llama.cpp's llama-mtmd-cli (default: not run)")
    p.add_argument("--layers", type=int, default=None, help="tower layers (default: Gemma 3 4B's 27)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out-dir", default=tempfile.gettempdir(), help="where the mmproj file is written")
    p.add_argument("--served", action="store_true", help="time to first token through `unison serve` "
                   "(and --llama-server beside it), then --clients pictures at once, instead")
    p.add_argument("--clients", type=int, default=4, help="--served: pictures sent at once")
    p.add_argument("--llama-server", default=None, help="--served: llama.cpp's llama-server (default: none)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    text = Path(args.text_model) if args.text_model else _test_gemma3()
    if not args.served:
        run(text, args.llama_mtmd, args.trials, args.layers, Path(args.out_dir))
        return
    from unison.model.weights.gguf import hf_config, open_gguf
    from unison.model.weights.gguf_header import MMPROJ_PROJECTORS

    hf, out = hf_config(open_gguf(text)), Path(args.out_dir)
    if MMPROJ_PROJECTORS.get(hf["model_type"]) == "qwen3vl_merger":
        from unison.bench import qwen_tower

        qwen = qwen_tower.qwen35_tower(int(hf["hidden_size"]), args.layers)
        text = qwen_tower.grown_qwen35(text, out / f"{text.stem}-vision-tokens.gguf")
        mmproj = qwen_tower.write_mmproj(qwen_tower.random_tower(qwen), qwen,
                                         out / f"mmproj-qwen3.5-tower-{qwen.depth}.gguf")
        return served(text, mmproj, args.clients, args.trials, args.llama_server)
    cfg = gemma3_tower(int(hf["hidden_size"]), args.layers)
    if int(hf["vocab_size"]) < IMAGE_VOCAB:  # (the 270M: no image token)
        text = grown_gemma3(text, out / f"{text.stem}-image-tokens.gguf")
    mmproj = write_mmproj(random_tower(cfg), cfg, out / f"mmproj-gemma3-4b-tower-{cfg.num_layers}.gguf")
    served(text, mmproj, args.clients, args.trials, args.llama_server)


def _test_gemma3() -> Path:
    try:
        from tests.models import gemma3_gguf
    except ImportError:
        raise SystemExit("give --text-model: a Gemma 3 GGUF (the default is the test suite's 270M)") from None
    return gemma3_gguf()
