"""`unison bench offline | latency`: the ceiling arithmetic on synthetic timings, the request
sources, and short real runs of the command (engine, transformers baseline, ceiling)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from unison import Engine, cli
from unison.bench import ceiling
from unison.bench.datasets import random_requests
from unison.model.weights.loader import default_gguf_path


def test_ceiling_total_of_shapes():
    shapes = Counter({(512, 4): 2, (64, 64): 10, (8, 0): 3})  # rows 0: no LM head that step
    assert ceiling.total(shapes, layers=lambda m: m / 1000, head=lambda m: m / 100) == pytest.approx(
        2 * (0.512 + 0.04) + 10 * (0.064 + 0.64) + 3 * 0.008)


def test_ceiling_timer_interpolates_only_between_measured_sizes():
    measured: list[int] = []

    def measure(m: int) -> float:
        measured.append(m)
        return 3.0 + 2.0 * m  # GEMM time is close to affine in the row count

    few = {1, 7, 64}
    at = ceiling._timer(few, measure)
    assert sorted(measured) == [1, 7, 64] and at(7) == 17.0
    measured.clear()
    many = set(range(1, 600, 3))  # 200 sizes: a grid instead, endpoints included
    at = ceiling._timer(many, measure)
    assert 1 in measured and 598 in measured and len(measured) < 100
    for m in many:
        assert at(m) == pytest.approx(3.0 + 2.0 * m)
    assert ceiling._timer(set(), measure)(5) == 0.0


def test_ceiling_counts_only_the_run():
    before = [[512, 1, 3], [64, 64, 10]]
    after = [[1, 1, 2], [512, 1, 5], [64, 64, 10]]
    assert ceiling.subtract(after, before) == Counter({(1, 1): 2, (512, 1): 2})


def test_random_offline_requests():
    reqs = random_requests(40, 100, 20, 0.5, vocab=49152, seed=3)
    assert reqs == random_requests(40, 100, 20, 0.5, vocab=49152, seed=3)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(1000 <= t < 49152 - 1000 for r in reqs for t in r.prompt)
    assert len({r.prompt_len for r in reqs}) > 10
    with pytest.raises(ValueError):
        random_requests(1, 10, 10, 1.0, vocab=49152, seed=0)


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "unison.cli", "bench", *args, "--quiet", "--num-threads", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_offline_run_beside_transformers(tmp_path):
    out = tmp_path / "result.json"
    proc = _bench("offline", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                  "--range-ratio", "0.5", "--baseline", "hf", "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "linear-layer ceiling" in proc.stdout and "output_tok_s" in proc.stdout
    result = json.loads(out.read_text())
    ours, hf = result["unison"], result["hf"]
    # ignore_eos: both produce exactly the requested tokens, so their rates compare like for like
    wanted = sum(r.output_len for r in random_requests(4, 16, 8, 0.5, vocab=49152, seed=0))
    assert ours["output_tokens"] == hf["output_tokens"] == wanted
    assert ours["output_tok_s"] == pytest.approx(wanted / ours["seconds"])
    # The ceiling times each linear as its own call; at this toy size (a few 1-16 row steps) that
    # per-call overhead is most of it, where the run makes one C call per step: near, not below.
    assert 0 < ours["ceiling_s"] < 1.5 * ours["seconds"]


def test_offline_run_on_sharegpt(tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"Tell me a story about the number {i}."},
                               {"from": "gpt", "value": "Once upon a time there was a number."}]}
            for i in range(5)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "result.json"
    proc = _bench("offline", "--dataset", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3",
                  "--no-ceiling", "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(out.read_text())["unison"]
    assert ours["requests_s"] * ours["seconds"] == pytest.approx(3)
    assert ours["output_tokens"] == 3 * 9  # each reply's token count, generated with ignore_eos


def test_latency_run():
    proc = _bench("latency", "--prompt-len", "48", "--output-len", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefill_tok_s" in proc.stdout and "decode_tok_s" in proc.stdout


def test_make_model_writes_a_llama_gguf_both_kinds_of_reader_load(tmp_path, capsys):
    """`bench make-model`'s writer, at a tiny shape: Unison serves it (int4 linears, the
    embedded tokenizer), and `bench kernels` times its linears on every path beside fp32."""
    from unison.bench.model import write_model

    shape = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}
    path = write_model(shape, tmp_path / "m.gguf")
    with Engine(model_path=str(path), max_total_tokens=512) as engine:
        info = engine.get_server_info()
        assert info["weights"]["layers.1.down"].startswith("int4/")
        assert info["weights"]["lm_head"].startswith("q8_0/")  # the file's Q8_0 embedding, as stored
        out = engine.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4
    capsys.readouterr()
    assert cli.main(["bench", "kernels", "--model-path", str(path), "--m", "1,16", "--reps", "1"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()[1:]
    assert "int4/" in header and "fp32" in header and [r.split()[0] for r in rows] == ["1", "16"]
    for dtype in ("int8", "float16"):  # one decode row's attention, small
        assert cli.main(["bench", "kernels", "--attention", "--keys", "300", "--head-dim", "64",
                         "--kv-cache-dtype", dtype, "--reps", "2", "--num-threads", "1"]) == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"one decode row over 300 keys, 16 heads of 64 (2 KV heads), {dtype} cache")


def test_make_model_writes_a_qwen35_moe_gguf_as_llama_cpp_lays_it_out(tmp_path):
    """The Qwen3.5-35B-A3B shape at a tiny size: Unison runs it (Q4_0 experts as stored, a state
    per request), and transformers' own GGUF loader, which undoes llama.cpp's converter, reads the
    same file into the same model: logits agree within the quantized activations' bound."""
    import torch
    from transformers import AutoModelForCausalLM

    from unison.bench.model import write_model
    from unison.model.runner import BatchItem, ModelRunner

    shape = {"hidden": 64, "layers": 4, "heads": 2, "kv_heads": 1, "head_dim": 64, "experts": 4, "top_k": 2,
             "ffn": 32, "shared_ffn": 32, "k_heads": 2, "v_heads": 4, "state": 32, "conv": 4}
    path = write_model(shape, tmp_path / "m.gguf")
    runner = ModelRunner(path, num_blocks=8, state_slots=1)
    assert runner.config.family.name == "qwen3_5_moe" and runner.config.linear.tiled
    assert runner.model.linear_kinds()["layers.0.experts"].startswith("int4/")
    ids = list(range(100, 130))
    ours = runner.forward([BatchItem(ids, 0, [0, 1], len(ids) - 1, state_slot=0)])[0]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.inference_mode():
        want = theirs(torch.tensor([ids])).logits[0, -1]
    gap = (torch.log_softmax(ours, -1) - torch.log_softmax(want, -1)).abs().max().item()
    assert gap < 0.15, gap


def test_bandwidth_bound_of_the_embedded_model(tmp_path, capsys):
    """`bench bandwidth`: a read speed, and the bytes a decode step of the embedded model reads:
    every weight as executed but the embedding, which is also its LM head (read whole)."""
    from unison.model.runner import ModelRunner

    out = tmp_path / "bound.json"
    assert cli.main(["bench", "bandwidth", "--model-path", str(default_gguf_path()), "--gib", "0.125",
                     "--trials", "2", "--result-file", str(out)]) == 0
    figures = json.loads(out.read_text())
    model = ModelRunner(None, num_blocks=1).model
    row = model.embed.nbytes // model.cfg.vocab_size
    assert figures["read_gbps"] > 0.5 and figures["step_bytes"] == model.weights_bytes() + row
    assert "one stream's bound" in capsys.readouterr().out


def test_activations_round_per_row_and_block():
    """`bench activations`' rounding: 32-blocks of each row to 8 or 16 bits around the block's
    largest magnitude; a zero block stays zero."""
    import torch

    from unison.bench.activations import rounded

    x = torch.randn(3, 70) * torch.logspace(-3, 3, 70)
    x[1, 32:64] = 0
    for bits, limit in ((8, 127), (16, 32767)):
        y = rounded(x, bits)
        blocks = torch.nn.functional.pad(x, (0, 26)).view(3, 3, 32).abs().amax(-1)
        step = torch.repeat_interleave(blocks / limit, 32, dim=1)[:, :70]
        # half a step, and the float32 rounding of x itself (one ulp: 16-bit steps go below it,
        # which failed 1 seed in 40)
        assert y.shape == x.shape and ((y - x).abs() <= step / 2 * 1.0001 + x.abs() * 2**-23 + 1e-12).all()
        assert (y[1, 32:64] == 0).all()


def test_make_model_in_f16_for_llama_quantize(tmp_path):
    """`make-model --qtype f16` (what llama-quantize is given): every linear, expert and the
    embedding in F16, which Unison reads (quantized to int8 at load)."""
    from gguf import GGUFReader

    from unison.bench.model import write_model
    from unison.model.runner import ModelRunner

    shape = {"hidden": 64, "layers": 1, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 4, "top_k": 2,
             "ffn": 32}
    path = write_model(shape, tmp_path / "m.gguf", float16=True)
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["token_embd.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == "F32"
    runner = ModelRunner(path, num_blocks=4)
    assert runner.model.linear_kinds()["layers.0.experts"].startswith("int8/")
