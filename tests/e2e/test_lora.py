"""LoRA adapters as engine-wide state: one registry in the core, used from every frontend.

The adapters are PEFT's file format with seeded random weights (bench lora's writer: no model to
build, so a module's adapters take a second), made once per module. The model side (the kernel,
the PEFT reader, parity with transformers + PEFT on adapters PEFT made) is tests/unit/test_lora_model.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.e2e.test_quant import INVARIANCE_PROMPTS
from tests.serving import assert_openai_error, serve
from tests.utils import wait_until
from unison import Engine
from unison.bench.lora import TARGETS, write_adapter
from unison.errors import UnknownAdapterError
from unison.model.weights.loader import resolve_model_dir

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = INVARIANCE_PROMPTS  # 16 short, different prompts


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """Four good adapters (other ranks, targets and seeds) and the bad ones of the refusals."""
    root, model_dir = tmp_path_factory.mktemp("adapters"), resolve_model_dir(None)
    made = {f"a{i}": write_adapter(root / f"a{i}", model_dir, rank=(4, 8, 4, 8)[i], seed=i, b_std=0.05,
                                   targets=("q_proj", "v_proj") if i == 2 else TARGETS)
            for i in range(4)}
    made["rank16"] = write_adapter(root / "rank16", model_dir, rank=16, seed=9)
    made["no_weights"] = _edited(made["a0"], root / "no_weights", drop_weights=True)
    made["fc1"] = _edited(made["a0"], root / "fc1", targets=["q_proj", "fc1"])
    made["lm_head"] = _edited(made["a0"], root / "lm_head", targets=["q_proj", "lm_head"], lm_head=True)
    return made


def _edited(good: Path, out: Path, *, drop_weights: bool = False, targets: list[str] | None = None,
            lm_head: bool = False) -> Path:
    shutil.copytree(good, out)
    if drop_weights:
        (out / "adapter_model.safetensors").unlink()
    if targets is not None:
        config = json.loads((out / "adapter_config.json").read_text())
        config["target_modules"] = targets
        (out / "adapter_config.json").write_text(json.dumps(config))
    if lm_head:  # as PEFT writes an lm_head LoRA: [r, hidden] and [vocab, r]
        tensors = load_file(out / "adapter_model.safetensors")
        a = next(t for k, t in tensors.items() if k.endswith("q_proj.lora_A.weight"))
        tensors["base_model.model.lm_head.lora_A.weight"] = a.clone()
        tensors["base_model.model.lm_head.lora_B.weight"] = a.new_zeros(49152, a.shape[0])
        save_file(tensors, out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def engine(adapters):
    with Engine(enable_lora=True, max_lora_rank=8, max_loras_per_batch=4, tokenizer_worker_num=2,
                lora_paths=[f"a0={adapters['a0']}", f"a1={adapters['a1']}"], max_total_tokens=8192) as e:
        assert e.load_lora_adapter("a2", str(adapters["a2"])).success
        assert e.load_lora_adapter("a3", str(adapters["a3"]), pinned=True).success
        yield e


def _ids(out: dict) -> list[int]:
    return out["output_ids"]


def _loaded(engine: Engine) -> dict[str, dict]:
    return {a["name"]: a for a in engine.get_server_info()["lora_adapters"]}


def test_mixed_batches_give_what_each_gives_alone(engine):
    """16 prompts on 4 adapters and the base, together, are bit-identical to each alone; and
    each adapter changes the output (the check could fail)."""
    loras = [None, "a0", "a1", "a2", "a3"] * 4
    loras = loras[:16]
    alone = [_ids(engine.generate(p, GREEDY, lora_path=lora)) for p, lora in zip(PROMPTS, loras)]
    together = [_ids(o) for o in engine.generate(PROMPTS, GREEDY, lora_path=loras)]
    assert together == alone
    base = [_ids(o) for o in engine.generate(PROMPTS[:5], GREEDY)]
    changed = [_ids(engine.generate(PROMPTS[i], GREEDY, lora_path=lora)) != base[i]
               for i, lora in enumerate(["a0", "a1", "a2", "a3"], start=1)]
    assert sum(changed) >= 3, changed


def test_the_prefix_cache_is_keyed_by_adapter(engine):
    """The same prompt under a0, a1, then the base: nothing cached for each first use, each its
    own output; a0 again hits its own blocks and gives the same output."""
    prompt = "An unrepeated prompt, long enough to fill a few KV blocks of sixteen tokens: " * 3
    params = {**GREEDY, "max_new_tokens": 8}
    outs = {lora: engine.generate(prompt, params, lora_path=lora) for lora in ("a0", "a1", None)}
    assert [o["meta_info"]["cached_tokens"] for o in outs.values()] == [0, 0, 0]
    assert len({tuple(_ids(o)) for o in outs.values()}) == 3
    again = engine.generate(prompt, params, lora_path="a0")
    assert again["meta_info"]["cached_tokens"] >= 32
    assert _ids(again) == _ids(outs["a0"])


@pytest.mark.parametrize("which, reason", [
    ("rank16", "rank 16"), ("no_weights", "adapter_model.safetensors"), ("fc1", "fc1"),
    ("lm_head", "lm_head"), ("missing", "does not exist"), ("duplicate", "already loaded")])
def test_bad_adapters_are_refused_without_effect(engine, adapters, which, reason, tmp_path):
    before = _loaded(engine)
    path = {"missing": tmp_path / "nowhere", "duplicate": adapters["a1"]}.get(which) or adapters.get(which)
    name = "a0" if which == "duplicate" else f"bad-{which}"
    result = engine.load_lora_adapter(name, str(path))
    assert not result and reason in result.message, result.message
    assert _loaded(engine).keys() == before.keys()
    assert _ids(engine.generate(PROMPTS[0], GREEDY, lora_path="a0")) == \
        _ids(engine.generate(PROMPTS[0], GREEDY, lora_path="a0"))


def test_an_unknown_adapter_is_refused_by_name_and_nothing_queued(engine):
    with pytest.raises(UnknownAdapterError, match="'nope' is not loaded") as e:
        engine.generate(PROMPTS[0], GREEDY, lora_path="nope")
    assert e.value.field == "lora_path"
    info = engine.get_server_info()
    assert info["num_running"] == info["num_waiting"] == 0


def test_unload_lets_requests_in_flight_finish_and_refuses_new_ones(engine, adapters):
    cached = engine.get_server_info()["kv_blocks_cached"]
    assert engine.load_lora_adapter("tmp", str(adapters["a0"])).success
    params = {**GREEDY, "max_new_tokens": 48}
    expected = _ids(engine.generate(PROMPTS[3], params, lora_path="tmp"))
    stream = engine.generate(PROMPTS[3], params, lora_path="tmp", stream=True)
    first = next(stream)
    result = engine.unload_lora_adapter("tmp")
    assert result.success and "in flight finish with it" in result.message, result.message
    with pytest.raises(UnknownAdapterError):
        engine.generate(PROMPTS[0], GREEDY, lora_path="tmp")
    *_, last = [first, *stream]
    assert last["output_ids"] == expected
    assert "tmp" not in _loaded(engine)
    # Freed with its last request: its cached prefixes too, which nothing could reuse.
    wait_until(lambda: engine.get_server_info()["kv_blocks_cached"] == cached, 10)
    assert not engine.unload_lora_adapter("tmp")  # gone


def test_loading_while_requests_run_changes_nothing_else(engine, adapters):
    params = {**GREEDY, "max_new_tokens": 40}
    expected = [_ids(o) for o in engine.generate(PROMPTS[:4], params, lora_path=["a0", None, "a1", None])]
    got: list = []
    worker = threading.Thread(target=lambda: got.extend(
        engine.generate(PROMPTS[:4], params, lora_path=["a0", None, "a1", None])))
    worker.start()
    wait_until(lambda: engine.get_server_info()["num_running"] > 0, 30)
    assert engine.load_lora_adapter("during", str(adapters["a2"])).success
    worker.join(60)
    assert [_ids(o) for o in got] == expected
    assert engine.unload_lora_adapter("during").success


def test_idle_unpinned_adapters_are_evicted_least_recently_used(adapters):
    with Engine(enable_lora=True, max_lora_rank=8, max_loaded_loras=2, max_total_tokens=2048) as e:
        assert e.load_lora_adapter("p", str(adapters["a0"]), pinned=True)
        assert e.load_lora_adapter("x", str(adapters["a1"]))
        loaded = e.load_lora_adapter("y", str(adapters["a2"]))
        assert loaded and "evicted 'x'" in loaded.message, loaded.message
        assert set(_loaded(e)) == {"p", "y"}
        e.generate(PROMPTS[0], GREEDY, lora_path="y")
        full = e.load_lora_adapter("z", str(adapters["a3"]))
        assert full and "evicted 'y'" in full.message  # the pinned one stays


def test_a_killed_frontend_frees_its_requests_hold_on_the_adapter(engine):
    """An attached process dies mid-request with an adapter: its request's reference goes with
    it, so the adapter is unloaded at once (not kept for a request nobody follows)."""
    assert engine.load_lora_adapter("held", str(_loaded(engine)["a1"]["path"])).success
    script = ("import sys; from unison import Engine; e = Engine.attach_tokenizer_worker(int(sys.argv[1])); "
              "e.generate('Tell me a long story:', {'max_new_tokens': 4000, 'ignore_eos': True}, "
              "lora_path='held')")
    proc = subprocess.Popen([sys.executable, "-c", script, str(os.getpid())])
    try:
        wait_until(lambda: _loaded(engine)["held"]["running"] == 1, 60)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    wait_until(lambda: engine.get_server_info()["num_running"] == 0, 30)
    result = engine.unload_lora_adapter("held")
    assert result.message == "unloaded LoRA adapter 'held'", result.message  # none in flight


# ---- the server: one registry for every HTTP worker and attached Engine ---------------------------


@pytest.fixture(scope="module")
def server(adapters):
    yield from serve("lora", "--enable-lora", "--max-lora-rank", "8", "--extra-frontends", "1",
                     "--lora-modules", f"a0={adapters['a0']}", "--max-total-tokens", "4096", workers=2)


def _client_on(server, worker_pid: int | None = None, not_pid: int | None = None) -> tuple[httpx.Client, int]:
    """A keep-alive connection to one worker (each connection stays with the worker that took
    it): the given one, or any but `not_pid`."""
    for _ in range(50):
        client = httpx.Client(base_url=server.url, headers=server.headers, timeout=60)
        pid = int(client.get("/v1/models").headers["x-unison-worker-pid"])
        if pid == worker_pid or (worker_pid is None and pid != not_pid):
            return client, pid
        client.close()
    raise AssertionError(f"50 connections never reached the worker wanted ({worker_pid} / not {not_pid})")


def test_an_adapter_loaded_through_one_worker_serves_from_every_frontend(server, adapters):
    first, loader = _client_on(server)
    second, other = _client_on(server, not_pid=loader)
    try:
        r = first.post("/load_lora_adapter", json={"lora_name": "shared", "lora_path": str(adapters["a1"])})
        assert r.status_code == 200 and r.json()["success"], r.text
        body = {"model": "shared", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
        served = second.post("/v1/completions", json=body)
        assert served.status_code == 200 and served.json()["model"] == "shared", served.text
        assert int(served.headers["x-unison-worker-pid"]) == other
        text = served.json()["choices"][0]["text"]
        attached = Engine.attach_tokenizer_worker(server.proc.pid)
        try:
            out = attached.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 12}, lora_path="shared")
        finally:
            attached.shutdown()
        assert out["text"] == text
        models = server.get("/v1/models").json()["data"]
        cards = {m["id"]: m for m in models}
        assert cards["shared"]["parent"] == cards["a0"]["parent"] == models[0]["id"]
        assert cards["shared"]["root"] == str(adapters["a1"])
        metrics = server.get("/metrics").text
        count = re.search(r'unison:lora_requests_total\{lora_name="shared"\} (\S+)', metrics)
        assert count and float(count[1]) == 2, metrics  # the second worker's and the attached Engine's

        r = second.post("/v1/unload_lora_adapter", json={"lora_name": "shared"})
        assert r.status_code == 200 and r.json()["success"], r.text
        refused = first.post("/v1/completions", json=body)
        assert int(refused.headers["x-unison-worker-pid"]) == loader
        assert assert_openai_error(refused, 404, "'shared'")["param"] == "model"
        native = first.post("/generate", json={"text": "Hi", "lora_path": "shared"})
        assert assert_openai_error(native, 400, "not loaded")["param"] == "lora_path"
    finally:
        first.close()
        second.close()
    assert server.server_info()["num_waiting"] == 0


def test_bad_loads_over_http_say_why(server, adapters):
    r = server.post("/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["rank16"])})
    assert r.status_code == 400 and not r.json()["success"] and "rank 16" in r.json()["message"]
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x"})
    assert assert_openai_error(r, 400, "lora_path")["param"] == "lora_path"
    r = server.post("/v1/unload_lora_adapter", {"lora_name": "never"})
    assert r.status_code == 400 and "not loaded" in r.json()["message"]
    assert {m["id"] for m in server.get("/v1/models").json()["data"]} >= {"a0"}
