"""Code written for sglang.Engine runs unchanged: its option and argument names, its defaults,
its result shapes, weight updates from disk and from tensors, and the three pause modes."""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.test_attach import AttachedProcess
from tests.e2e.test_engine import PROMPTS, wait_idle
from tests.utils import wait_until
from unison import Engine
from unison.config import EngineConfig
from unison.errors import InvalidParam
from unison.model.weights.loader import default_gguf_path
from unison.model.weights.sources import TENSOR_FILE_DIRS, TENSOR_FILE_PREFIX

GREEDY = {"temperature": 0, "max_new_tokens": 16}
LONG = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}


# ---- tiny checkpoints: the embedded model's tokenizer, a random two-layer Llama ----------------


def write_tiny(path: Path, tokenizer_dir: Path, seed: int, hidden: int = 64) -> Path:
    """A 13 MB safetensors checkpoint: weights wide enough (std 0.2) that outputs differ per seed."""
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": hidden,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(cfg))
    g, d, kv = torch.Generator().manual_seed(seed), hidden // 4, 2 * (hidden // 4)
    shapes = {"model.embed_tokens.weight": (49152, hidden), "model.norm.weight": (hidden,)}
    for i in range(2):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   a + "q_proj.weight": (4 * d, hidden), a + "k_proj.weight": (kv, hidden),
                   a + "v_proj.weight": (kv, hidden), a + "o_proj.weight": (hidden, 4 * d),
                   m + "gate_proj.weight": (128, hidden), m + "up_proj.weight": (128, hidden),
                   m + "down_proj.weight": (hidden, 128)}
    tensors = {n: (1 + 0.1 * torch.randn(s, generator=g)) if n.endswith("norm.weight")
               else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"a": write_tiny(root / "a", model_dir, 0), "b": write_tiny(root / "b", model_dir, 1),
            "narrow": write_tiny(root / "narrow", model_dir, 0, hidden=32)}


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    with Engine(model_path=str(tiny["a"]), tokenizer_worker_num=2, num_threads=1,
                max_total_tokens=8192) as e:
        yield e
        e.update_weights_from_disk(str(tiny["a"]))


@pytest.fixture(scope="module")
def engine():
    with Engine(num_threads=1, max_total_tokens=16384, chunked_prefill_size=128) as e:
        yield e


def greedy_texts(engine: Engine, n: int = 3) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(PROMPTS[:n], GREEDY)]


# ---- options and signatures --------------------------------------------------------------------


def test_sglang_options_map_and_the_rest_are_refused_by_name():
    cfg = EngineConfig.from_kwargs(random_seed=0, mem_fraction_static=0.8, tp_size=1, dp_size=1,
                                   disable_cuda_graph=True, chunked_prefill_size=-1,
                                   max_running_requests=None, schedule_policy="random", dtype="float")
    assert cfg.random_seed == 0 and cfg.mem_fraction_static == 0.8 and cfg.dtype == "float32"
    assert cfg.max_running_requests == 64 and cfg.chunked_prefill_size >= 1 << 20
    with pytest.raises(ValueError, match="tp_size may only be 1"):
        EngineConfig.from_kwargs(tp_size=2)
    with pytest.raises(ValueError, match=r"SGLang option\(s\) \['attention_backend'\] are not supported"):
        EngineConfig.from_kwargs(attention_backend="flashinfer")
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_kwargs(attention_backnd="flashinfer")
    with pytest.raises(ValueError, match="SGLang policy Unison does not have"):
        EngineConfig.from_kwargs(schedule_policy="dfs-weight")
    with pytest.raises(ValueError, match="mem_fraction_static must be in"):
        EngineConfig.from_kwargs(mem_fraction_static=1.5)


def test_generate_signature_is_sglangs():
    for method in (Engine.generate, Engine.async_generate):
        params = list(inspect.signature(method).parameters.values())[1:]
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == ["prompt", "sampling_params", "input_ids", "image_data"]
        defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
        assert defaults | {"return_logprob": False, "logprob_start_len": None, "top_logprobs_num": None,
                           "token_ids_logprob": None, "stream": False, "rid": None,
                           "priority": None} == defaults


def test_unsupported_generate_arguments_are_refused_by_name(engine):
    for name, value in [("audio_data", "cat.wav"), ("custom_logit_processor", "{}"),
                        ("session_params", {"id": "s"})]:
        with pytest.raises(InvalidParam, match=f"{name} is not supported by Unison") as e:
            engine.generate("Hi", GREEDY, **{name: value})
        assert e.value.field == name
    with pytest.raises(InvalidParam, match="this model takes no images") as e:  # a text-only model's
        engine.generate("Hi", GREEDY, image_data=b"cat")
    assert e.value.field == "image_data"
    with pytest.raises(TypeError, match="unexpected keyword argument 'imagedata'"):
        engine.generate("Hi", GREEDY, imagedata="x")
    out = engine.generate("Hi", GREEDY, None, None, lora_path=None, return_hidden_states=False,
                          logprob_start_len=None, top_logprobs_num=None, priority=None)
    assert out["meta_info"]["completion_tokens"] > 0


# ---- arguments, sampling parameters and output shapes ------------------------------------------


def test_per_prompt_arguments_and_token_ids_logprob(engine):
    plain = engine.generate(PROMPTS[:2], GREEDY)
    ids = sorted({t for o in plain for t in o["output_ids"]})[:6]
    outs = engine.generate(PROMPTS[:2], GREEDY, return_logprob=[True, False],
                           top_logprobs_num=[2, None], token_ids_logprob=ids, rid=["pp-0", "pp-1"])
    first, second = outs
    assert [o["meta_info"]["id"] for o in outs] == ["pp-0", "pp-1"]
    assert "output_token_logprobs" not in second["meta_info"]
    meta = first["meta_info"]
    by_id = meta["output_token_ids_logprobs"]
    assert len(by_id) == len(first["output_ids"]) and all(len(row) == len(ids) for row in by_id)
    for (lp, tok, _), row in zip(meta["output_token_logprobs"], by_id):
        assert [t for _, t, _ in row] == ids
        if tok in ids:  # the chosen token's logprob, found again among the given ids
            assert dict((t, v) for v, t, _ in row)[tok] == pytest.approx(lp, abs=1e-5)
    with_prompt = engine.generate(PROMPTS[0], GREEDY, return_logprob=True, logprob_start_len=0,
                                  token_ids_logprob=ids)["meta_info"]
    rows = with_prompt["input_token_ids_logprobs"]
    assert rows[0] is None and len(rows) == with_prompt["prompt_tokens"]
    with pytest.raises(InvalidParam, match="token_ids_logprob"):
        engine.generate("Hi", GREEDY, return_logprob=True, token_ids_logprob=[10**9])


def test_max_new_tokens_none_stop_regex_and_finish_reasons(engine):
    out = engine.generate("Count: 1, 2,", {"temperature": 0, "max_new_tokens": 40, "stop_regex": r"\d, \d"})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d, \d"}
    assert out["text"] == " 3, 4", out["text"]  # kept up to the match's end, nothing after it
    # None: up to what the context and the KV cache leave (here the 16,384-token cache)
    long = engine.generate("Hi", {"max_new_tokens": None, "ignore_eos": True, "temperature": 0},
                           stream=True)
    first = next(long)
    long.close()
    assert first["meta_info"]["finish_reason"] is None
    length = engine.generate("Hi", {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    with pytest.raises(InvalidParam, match="stop_regex") as e:
        engine.generate("Hi", {"stop_regex": "("})
    assert e.value.field == "stop_regex"


def test_server_info_has_sglangs_keys_and_ours(engine):
    info = engine.get_server_info()
    for key in ("model_path", "chunked_prefill_size", "max_running_requests", "random_seed",
                "status", "max_total_num_tokens", "max_req_input_len", "internal_states", "version"):
        assert key in info, key
    assert info["status"] == "ready" and info["max_total_num_tokens"] == info["max_total_tokens"] == 16384
    assert info["internal_states"][0]["num_running"] == info["num_running"]
    assert info["core_pid"] > 0 and info["config"]["max_total_tokens"] == 16384
    assert engine.get_model_info()["is_generation"] is True


# ---- pause modes -------------------------------------------------------------------------------


def _streams(engine: Engine, prompts: list[str], params: dict) -> tuple[list, list[threading.Thread]]:
    """Each prompt streamed in a thread; results[i] is its last item (or the exception)."""
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            *_, results[i] = engine.generate(prompts[i], params, stream=True)
        except Exception as e:  # noqa: BLE001 - reported by the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return results, threads


def _running(engine: Engine, n: int) -> None:
    wait_until(lambda: engine.get_server_info()["num_running"] == n
               and engine.get_server_info()["stats"]["generation_tokens"] > 0, 20, f"{n} requests running")


def test_pause_abort_ends_requests_frees_kv_and_holds_new_ones(engine):
    results, threads = _streams(engine, PROMPTS[:3], LONG)
    _running(engine, 3)
    engine.pause_generation()  # SGLang's default mode: abort
    try:
        for t in threads:
            t.join(10)
        assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort"] * 3, results
        assert "paused" in results[0]["meta_info"]["finish_reason"]["message"]
        info = engine.get_server_info()
        assert info["paused"] and info["pause_mode"] == "abort" and info["kv_blocks_used"] == 0
        engine.check_integrity()
        held, threads = _streams(engine, PROMPTS[3:4], GREEDY)  # queued, not refused, not run
        wait_until(lambda: engine.get_server_info()["num_waiting"] == 1, 10, "the new request queued")
        assert held[0] is None and engine.get_server_info()["num_running"] == 0
    finally:
        engine.continue_generation()
    threads[0].join(20)
    assert held[0]["meta_info"]["finish_reason"] is not None
    wait_idle(engine)


def test_pause_retract_frees_kv_and_resumes_to_the_same_greedy_output(engine):
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    reference = [o["output_ids"] for o in engine.generate(PROMPTS[:2], params)]
    results, threads = _streams(engine, PROMPTS[:2], params)
    _running(engine, 2)
    engine.pause_generation(mode="retract")
    try:
        info = engine.get_server_info()
        assert info["num_running"] == 0 and info["num_waiting"] == 2 and info["kv_blocks_used"] == 0
        engine.check_integrity()
        assert engine.flush_cache(), "nothing holds KV after a retract: the cache can go"
    finally:
        engine.continue_generation()
    for t in threads:
        t.join(30)
    assert [r["output_ids"] for r in results] == reference


def test_pause_in_place_keeps_kv_and_refuses_flush(engine):
    results, threads = _streams(engine, PROMPTS[:2], dict(LONG, max_new_tokens=64))
    _running(engine, 2)
    engine.pause_generation(mode="in_place")
    try:
        info = engine.get_server_info()
        assert info["num_running"] == 2 and info["kv_blocks_used"] > 0
        result = engine.flush_cache()
        assert not result and "hold KV" in result.message
        with pytest.raises(ValueError, match="mode must be one of"):
            engine.pause_generation(mode="sideways")
    finally:
        engine.continue_generation()
    for t in threads:
        t.join(30)
    assert [r["meta_info"]["finish_reason"] for r in results] == [{"type": "length", "length": 64}] * 2


# ---- weight updates ----------------------------------------------------------------------------


def test_reload_same_weights_is_identical_and_other_weights_change_outputs(tiny_engine, tiny):
    before = greedy_texts(tiny_engine)
    ok, message, paused = tiny_engine.update_weights_from_disk(str(tiny["a"]))
    assert ok and paused == 0, message
    assert greedy_texts(tiny_engine) == before
    assert tiny_engine.get_server_info()["kv_blocks_cached"] > 0
    ok, message, _ = tiny_engine.update_weights_from_disk(str(tiny["b"]))
    assert ok, message
    info = tiny_engine.get_server_info()  # the prefix cache held KV of the old weights: emptied
    assert info["model_path"] == str(tiny["b"]) and info["kv_blocks_cached"] == 0
    assert greedy_texts(tiny_engine) != before
    assert tiny_engine.get_model_info()["weight_version"] >= 2


def test_mismatched_checkpoint_is_refused_and_old_weights_serve(tiny_engine, tiny):
    before = greedy_texts(tiny_engine)
    ok, message, _ = tiny_engine.update_weights_from_disk(str(tiny["narrow"]))
    assert not ok and "hidden_size=32" in message, message
    ok, message, _ = tiny_engine.update_weights_from_disk(str(default_gguf_path()))
    assert not ok and "hidden_size=576" in message, message
    ok, message, _ = tiny_engine.update_weights_from_disk("/nonexistent/model")
    assert not ok and "does not exist" in message
    assert greedy_texts(tiny_engine) == before


def test_attached_frontend_keeps_generating_across_a_reload(tiny_engine, tiny):
    tiny_engine.update_weights_from_disk(str(tiny["a"]))
    with contextlib.closing(AttachedProcess(tiny_engine)) as child:
        first = child.call("generate", prompt=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
        ok, message, _ = tiny_engine.update_weights_from_disk(str(tiny["b"]))
        assert ok, message
        after = child.call("generate", prompt=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
        assert after != first
        assert after == tiny_engine.generate(PROMPTS[0], GREEDY)["output_ids"]
        # ... and it can update the weights too: the core does it for whichever frontend asks
        assert child.call("update_weights_from_disk", model_path=str(tiny["a"]))[0]
    assert tiny_engine.generate(PROMPTS[0], GREEDY)["output_ids"] == first


@pytest.mark.parametrize("abort_all", [False, True])
def test_reload_while_8_requests_stream(tiny_engine, tiny, abort_all):
    results, threads = _streams(tiny_engine, [PROMPTS[i % len(PROMPTS)] for i in range(8)],
                                dict(LONG, max_new_tokens=400))
    _running(tiny_engine, 8)
    ok, message, _ = tiny_engine.update_weights_from_disk(str(tiny["b"]), abort_all_requests=abort_all)
    assert ok, message
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a request hung across the reload"
    ends = [r["meta_info"]["finish_reason"] for r in results]
    if abort_all:  # ended at once, KV freed, as aborted
        assert all(e["type"] == "abort" and "weights" in e["message"] for e in ends), ends
    else:  # the update waited for them: each ran to its length on the old weights
        assert ends == [{"type": "length", "length": 400}] * 8
    wait_idle(tiny_engine)
    tiny_engine.check_integrity()
    tiny_engine.update_weights_from_disk(str(tiny["a"]))


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def tensor_files() -> list[Path]:
    return [f for d in TENSOR_FILE_DIRS for f in d.glob(f"{TENSOR_FILE_PREFIX}*")]


def test_update_from_tensors_is_the_update_from_disk(tiny_engine, tiny):
    tiny_engine.update_weights_from_disk(str(tiny["a"]))
    before = greedy_texts(tiny_engine)
    a, b = checkpoint_tensors(tiny["a"]), checkpoint_tensors(tiny["b"])
    ok, message = tiny_engine.update_weights_from_tensor(list(b.items()))
    assert ok and message.startswith(f"{len(b)} tensor(s) updated"), message
    assert tiny_engine.get_server_info()["kv_blocks_cached"] == 0  # flushed: KV of the old weights
    from_tensors = greedy_texts(tiny_engine)
    assert from_tensors != before
    assert tiny_engine.update_weights_from_disk(str(tiny["b"]))[0]
    assert greedy_texts(tiny_engine) == from_tensors
    # A subset: one tensor of a's, the rest stay b's; one tensor under two names works too.
    up = "model.layers.{}.mlp.up_proj.weight"
    assert tiny_engine.update_weights_from_tensor([("model.norm.weight", a["model.norm.weight"]),
                                                   (up.format(0), a[up.format(0)]),
                                                   (up.format(1), a[up.format(0)])])[0]
    assert greedy_texts(tiny_engine) not in (before, from_tensors)
    # Back to a's in two updates, a dict each, the first keeping the prefix cache.
    names = sorted(a)
    greedy_texts(tiny_engine)
    assert tiny_engine.update_weights_from_tensor({n: a[n] for n in names[:9]}, flush_cache=False)[0]
    assert tiny_engine.get_server_info()["kv_blocks_cached"] > 0
    assert tiny_engine.update_weights_from_tensor({n: a[n] for n in names[9:]})[0]
    assert greedy_texts(tiny_engine) == before
    assert not tensor_files(), "a tensor file was left in shared memory"


def test_tensor_updates_that_do_not_fit_are_refused_and_change_nothing(tiny_engine, tiny):
    tiny_engine.update_weights_from_disk(str(tiny["a"]))
    before = greedy_texts(tiny_engine)
    norm = ("model.norm.weight", torch.full((64,), 2.0))
    for pairs, reason in [
        ([norm, ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))],
         "has no weight 'model.layers.9.mlp.up_proj.weight'"),
        ([("lm_head.weight", torch.zeros(49152, 64))], "tied"),
        ([norm, ("model.layers.0.input_layernorm.weight", torch.ones(32))],
         "is [32], the running model's is [64]"),
    ]:
        ok, message = tiny_engine.update_weights_from_tensor(pairs)
        assert not ok and reason in message, message
    for pairs, reason in [([("model.norm.weight",)], r"named_tensors\[0\] must be a \(name, tensor\) pair"),
                          ([(1, torch.ones(64))], r"must be \(str, torch.Tensor\), got \(int, Tensor\)"),
                          ([("model.norm.weight", torch.ones(64, dtype=torch.int64))], "torch.int64"),
                          ([norm, norm], "names 'model.norm.weight' twice")]:
        with pytest.raises(InvalidParam, match=reason):
            tiny_engine.update_weights_from_tensor(pairs)
    with pytest.raises(InvalidParam, match="load_format='flattened_bucket'"):
        tiny_engine.update_weights_from_tensor([norm], load_format="flattened_bucket")
    assert greedy_texts(tiny_engine) == before
    assert tiny_engine.update_weights_from_tensor([]) == (True, "no tensors given: nothing updated")
    assert not tensor_files(), "a tensor file was left in shared memory"


def test_tensor_files_go_to_disk_when_shared_memory_is_full(tmp_path, monkeypatch):
    from unison.model.weights import sources as weights

    full, disk = tmp_path / "shm", tmp_path / "disk"
    full.mkdir()
    disk.mkdir()
    real = weights._save_file

    def save(tensors, directory):
        if directory == full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, directory)

    monkeypatch.setattr(weights, "_save_file", save)
    shared = torch.arange(6.0)
    path = weights.save_tensors({"a": shared, "b": shared, "c": shared[2:4]}, [full, disk])
    assert path.parent == disk
    assert {k: v.tolist() for k, v in load_file(path).items()} == {
        "a": [0, 1, 2, 3, 4, 5], "b": [0, 1, 2, 3, 4, 5], "c": [2, 3]}
    def refuse(tensors, directory):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(weights, "_save_file", refuse)
    with pytest.raises(PermissionError):  # only a full directory sends the file on to the next
        weights.save_tensors({"a": shared}, [full, disk])


# ---- engines of their own ----------------------------------------------------------------------


def test_skip_tokenizer_init_takes_and_returns_ids(tiny):
    with Engine(model_path=str(tiny["a"]), skip_tokenizer_init=True, num_threads=1,
                max_total_tokens=2048) as e:
        assert e.tokenizer is None
        out = e.generate(input_ids=[1, 2, 3, 4], sampling_params=GREEDY)
        assert "text" not in out and len(out["output_ids"]) == out["meta_info"]["completion_tokens"] > 0
        with pytest.raises(InvalidParam, match="no tokenizer") as err:
            e.generate("Hello", GREEDY)
        assert err.value.field == "prompt"
        with pytest.raises(InvalidParam, match="stop needs a tokenizer"):
            e.generate(input_ids=[1, 2], sampling_params={"stop": "x"})


def test_stream_output_yields_disjoint_segments(tiny):
    with Engine(model_path=str(tiny["a"]), stream_output=True, num_threads=1, max_total_tokens=2048) as e:
        whole = e.generate(PROMPTS[0], GREEDY)
        parts = list(e.generate(PROMPTS[0], GREEDY, stream=True))
    assert len(parts) > 1
    assert "".join(p["text"] for p in parts) == whole["text"]
    assert [t for p in parts for t in p["output_ids"]] == whole["output_ids"]


SCRIPT = """
    import asyncio
    import sys

    import unison as sgl  # the one line that differs from the same script on SGLang

    def main():
        llm = sgl.Engine(model_path=sys.argv[1], random_seed=0, mem_fraction_static=0.5, tp_size=1,
                         dp_size=1, disable_cuda_graph=True, context_length=1024,
                         chunked_prefill_size=-1, max_running_requests=8, max_total_tokens=4096,
                         schedule_policy="lpm", log_level="error", skip_tokenizer_init=False,
                         stream_output=False)
        prompts = ["Hello, my name is", "The capital of France is"]
        outputs = llm.generate(prompts, {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 8})
        for prompt, output in zip(prompts, outputs):
            print("===============================")
            print(f"Prompt: {prompt}\\nGenerated text: {output['text']}")
            assert output["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        for chunk in llm.generate(prompts[1], {"temperature": 0, "max_new_tokens": 4}, stream=True):
            pass
        async def go():
            return await llm.async_generate(prompts[0], {"temperature": 0, "max_new_tokens": 4})
        print("async:", asyncio.run(go())["text"])
        out = llm.generate(prompts[0], {"max_new_tokens": 4}, return_logprob=True,
                           top_logprobs_num=2, token_ids_logprob=[1, 2])
        assert len(out["meta_info"]["output_token_ids_logprobs"]) == 4
        assert llm.flush_cache().success
        info = llm.get_server_info()
        print("tokens:", info["max_total_num_tokens"], info["internal_states"][0]["num_running"])
        success, message, _ = llm.update_weights_from_disk(model_path=sys.argv[1])
        assert success, message
        llm.pause_generation(mode="in_place")
        llm.continue_generation()
        llm.shutdown()
        print("done")

    if __name__ == "__main__":
        main()
"""


def test_an_sglang_engine_script_runs_with_only_the_import_changed(tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run = subprocess.run([sys.executable, str(script), str(default_gguf_path())], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Generated text:" in run.stdout and "tokens: 4096 0" in run.stdout
    assert run.stdout.strip().endswith("done")


def test_sglangs_other_methods_say_why_there_are_none(engine):
    for name in ("freeze_gc", "open_session", "load_lora_adapter_from_tensors", "release_memory_occupation"):
        with pytest.raises(AttributeError, match=f"Engine.{name} .* is not supported by Unison: "):
            getattr(engine, name)
    ok, message = engine.update_weights_from_tensor([("model.norm.weight", torch.ones(576))])
    assert not ok and "quantized ('int4')" in message, message  # the embedded GGUF runs as int4
    assert engine.get_all_child_pids() == [engine.get_server_info()["core_pid"]]
    with pytest.raises(AttributeError, match="has no attribute 'no_such_method'"):
        engine.no_such_method  # noqa: B018
