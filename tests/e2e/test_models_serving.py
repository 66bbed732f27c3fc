"""`unison serve` with several models: each its own core, loaded on first use, unloaded when idle or
least recently used, restarted after a crash; nothing left behind on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.models import gemma3_gguf, minilm_dir
from tests.serving import ModelsServer, assert_openai_error, models_server
from tests.utils import HTTP, wait_until
from unison.deploy.model_pool import check_name, find_models
from unison.model.weights.loader import default_gguf_path

SMOL = default_gguf_path()
PROMPT = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
KV_EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
             "replay_endpoint": "tcp://127.0.0.1:*"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """Two small generators, an embedding model and a file that is no model."""
    d = tmp_path_factory.mktemp("models-dir")
    (d / "smol.gguf").symlink_to(SMOL)
    (d / "gemma.gguf").symlink_to(gemma3_gguf())
    (d / "minilm").symlink_to(minilm_dir())
    (d / "broken.gguf").write_bytes(b"not a gguf file")
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, models_dir):
    # --enable-lora: for the decoders; the embedding model's core starts without it. KV events:
    # each core publishes on ports of its own.
    with models_server(tmp_path_factory, "--models-dir", str(models_dir), "--models-max", "2",
                       "--enable-lora", "--kv-events-config", json.dumps(KV_EVENTS), workers=2) as s:
        yield s


def test_names_and_paths_are_checked(tmp_path):
    with pytest.raises(ValueError, match="model name '../x'"):
        check_name("../x", "--model")
    with pytest.raises(ValueError, match="model name 'a/b'"):
        find_models(None, [f"a/b={SMOL}"])
    with pytest.raises(ValueError, match="given twice"):
        find_models(None, [f"a={SMOL}", f"a={SMOL}"])
    with pytest.raises(FileNotFoundError, match="'nowhere' does not exist"):
        find_models(None, ["a=nowhere"])
    with pytest.raises(ValueError, match="holds no model"):
        find_models(str(tmp_path), [])


def test_lists_every_model_before_any_loads(server):
    models = server.models()
    assert list(models) == ["broken", "gemma", "minilm", "smol"]
    assert {m["state"] for m in models.values()} == {"unloaded"}
    assert models["minilm"]["task"] == "embed" and models["smol"]["task"] == "generate"
    err = assert_openai_error(server.post("/v1/completions", {**PROMPT, "model": "nope"}), 404, "'nope'",
                              "smol", "gemma")
    assert err["param"] == "model"
    assert_openai_error(server.post("/v1/completions", {**PROMPT, "model": "../smol"}), 404, "does not exist")
    assert_openai_error(server.post("/v1/completions", PROMPT), 400, "model is required")
    assert_openai_error(HTTP.get(f"{server.url}/v1/models/nope"), 404, "'nope'")
    assert {m["state"] for m in server.models().values()} == {"unloaded"}  # nothing was loaded


def test_concurrent_requests_share_one_load(server):
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(server.post("/v1/completions",
                                                                          {**PROMPT, "model": "smol"})))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert len({r.json()["choices"][0]["text"] for r in results}) == 1
    assert server.output().count("loading model 'smol'") == 1
    assert server.models()["smol"]["state"] == "loaded"
    r = server.post("/v1/embeddings", {"model": "minilm", "input": ["Paris is the capital of France."]})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


@contextlib.contextmanager
def streaming(server: ModelsServer, model: str, hold: bool = False):
    """A long generation of `model` in flight while the block runs (closed after it). `hold`: paused
    in place once started (continued at the end), so that it stays in flight however long the
    block takes on a busy machine."""
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{server.url}/v1/completions",
            json={"model": model, "prompt": "Once upon a time", "max_tokens": 5000, "ignore_eos": True,
                  "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
        if hold:
            paused = server.post("/pause_generation", {"model": model, "mode": "in_place"})
            assert paused.status_code == 200, paused.text
        try:
            yield lines
        finally:
            if hold:
                server.post("/continue_generation", {"model": model})


def test_lru_unloading_never_stops_a_core_with_requests_in_flight(server):
    # smol and minilm are loaded (the test above); smol is the least recently used once minilm serves.
    smol_pid = server.models()["smol"]["core_pid"]
    with streaming(server, "smol", hold=True):
        assert server.post("/v1/embeddings", {"model": "minilm", "input": "x"}).status_code == 200
        # At --models-max 2 gemma needs a core's room: smol's is busy, so minilm's is stopped.
        assert server.post("/v1/completions", {**PROMPT, "model": "gemma"}).status_code == 200
        models = server.models()
        assert (models["smol"]["state"], models["minilm"]["state"], models["gemma"]["state"]) == \
            ("loaded", "unloaded", "loaded")
        assert models["smol"]["core_pid"] == smol_pid
        with streaming(server, "gemma", hold=True):
            # Both cores serve requests: a third model cannot load, and says why.
            r = server.post("/v1/embeddings", {"model": "minilm", "input": "x"})
            assert_openai_error(r, 503, "--models-max 2", "in flight")
    assert server.models()["smol"]["core_pid"] == smol_pid


def test_a_core_killed_mid_stream_fails_only_its_requests_and_starts_again(server):
    gemma_pid = server.models()["gemma"]["core_pid"]
    with streaming(server, "gemma") as lines:
        os.kill(gemma_pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    errors = [json.loads(line[6:])["error"] for line in rest if line.startswith('data: {"error"')]
    assert errors and "engine" in errors[0]["message"], rest[-3:]
    assert rest[-1] == "data: [DONE]"
    assert server.post("/v1/completions", {**PROMPT, "model": "smol"}).status_code == 200  # serves on
    wait_until(lambda: server.state("gemma") == "unloaded", 5, "the pool to see gemma's core exit")
    assert "exited" in server.models()["gemma"]["error"]
    r = server.post("/v1/completions", {**PROMPT, "model": "gemma"})
    assert r.status_code == 200, r.text
    assert server.models()["gemma"]["core_pid"] not in (None, gemma_pid)


def test_a_model_that_fails_to_load_stays_failed_until_its_file_changes(server, models_dir):
    r = server.post("/v1/completions", {**PROMPT, "model": "broken"})
    assert_openai_error(r, 500, "'broken' failed to load")
    assert server.models()["broken"]["state"] == "failed"
    again = server.post("/v1/completions", {**PROMPT, "model": "broken"})
    assert_openai_error(again, 500, "once its file changes")
    (models_dir / "broken.gguf").write_bytes(b"still not a gguf file")
    r = server.post("/v1/completions", {**PROMPT, "model": "broken"})
    assert_openai_error(r, 500, "'broken' failed to load")
    assert "once its file changes" not in r.json()["error"]["message"]  # it was tried again
    assert server.output().count("loading model 'broken'") == 2


def test_load_unload_metrics_and_server_info_per_model(server):
    r = server.post("/models/unload", {"model": "smol"})
    assert r.status_code == 200 and r.json()["model"]["state"] == "unloaded", r.text
    r = server.post("/models/load", {"model": "smol"})
    assert r.status_code == 200 and r.json()["model"]["state"] == "loaded", r.text
    assert_openai_error(server.post("/models/load", {"model": "../smol"}), 404, "does not exist")
    with streaming(server, "smol"):
        assert_openai_error(server.post("/models/unload", {"model": "smol"}), 409, "in flight")
        r = server.post("/pause_generation", {"model": "smol", "mode": "in_place"})
        assert r.status_code == 200, r.text
        assert server.post("/continue_generation", {"model": "smol"}).status_code == 200
    loaded = {n for n, m in server.models().items() if m["state"] == "loaded"}
    metrics = HTTP.get(f"{server.url}/metrics").text
    for name in loaded:
        assert f'unison:num_requests_running{{model_name="{name}"}}' in metrics
    info = HTTP.get(f"{server.url}/get_server_info").json()
    rows = {m["name"]: m for m in info["models"]}
    assert {n for n, m in rows.items() if m["server_info"] is not None} == loaded
    assert rows["smol"]["server_info"]["core_pid"] == rows["smol"]["core_pid"]
    tags = HTTP.get(f"{server.url}/api/tags").json()["models"]
    assert [t["name"] for t in tags] == ["broken", "gemma", "minilm", "smol"]
    r = HTTP.post(f"{server.url}/flush_cache?model=smol")
    assert r.status_code == 200 and r.json()["success"], r.text


def test_kv_events_prefix_cache_and_structured_output_per_model(server):
    import zmq

    for name in ("smol", "gemma"):
        assert server.post("/v1/completions", {**PROMPT, "model": name}).status_code == 200
    infos = {m["name"]: m["server_info"] for m in HTTP.get(f"{server.url}/get_server_info").json()["models"]
             if m["name"] in ("smol", "gemma")}
    endpoints = {name: info["kv_events"]["endpoint"] for name, info in infos.items()}
    assert endpoints["smol"] != endpoints["gemma"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoints["smol"])
        wait_until(lambda: server.post("/v1/completions", {**PROMPT, "model": "smol", "prompt": "x " * 40})
                   and sub.poll(200), 10, "smol's core to publish KV events")
    finally:
        sub.close(0)
        ctx.term()
    again = server.post("/v1/completions", {**PROMPT, "model": "smol", "prompt": "x " * 40}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # smol's prefix cache
    # (a bounded string: the whole object fits in max_tokens whatever the model writes)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
              "required": ["city"]}
    r = server.post("/v1/chat/completions", {
        "model": "smol", "messages": [{"role": "user", "content": "Name a city in France as JSON."}],
        "max_tokens": 64, "temperature": 0, "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "city", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert "city" in json.loads(r.json()["choices"][0]["message"]["content"])


def test_lora_adapters_per_model(server, tmp_path):
    from tests.adapters import make_adapter

    adapter = make_adapter(tmp_path / "a", rank=4, seed=1)
    assert server.post("/v1/completions", {**PROMPT, "model": "smol"}).status_code == 200  # loaded
    r = server.post("/load_lora_adapter", {"model": "smol", "lora_name": "pirate", "lora_path": str(adapter)})
    assert r.status_code == 200 and r.json()["success"], r.text
    base = server.post("/v1/completions", {**PROMPT, "model": "smol", "max_tokens": 12}).json()
    tuned = server.post("/v1/completions", {**PROMPT, "model": "pirate", "max_tokens": 12})
    assert tuned.status_code == 200 and tuned.json()["model"] == "pirate", tuned.text
    assert tuned.json()["choices"][0]["text"] != base["choices"][0]["text"]
    assert server.models()["pirate"]["parent"] == "smol"
    assert HTTP.get(f"{server.url}/v1/models/pirate").json()["parent"] == "smol"
    r = server.post("/load_lora_adapter", {"model": "nope", "lora_name": "x", "lora_path": str(adapter)})
    assert_openai_error(r, 404, "'nope' does not exist")


def test_a_load_past_its_timeout_stops_the_core_and_can_be_tried_again():
    from unison.config import EngineConfig
    from unison.deploy.model_pool import ModelPool, ModelSource

    config = EngineConfig.from_kwargs(num_threads=1)
    pool = ModelPool(config, [ModelSource("smol", str(SMOL))], frontends=1, models_max=1,
                     idle_unload_s=None, load_timeout=0.2)
    try:
        with pytest.raises(RuntimeError, match=r"did not load within 0.2 s \(--model-load-timeout\)"):
            pool.load_now("smol")
        assert pool.slots["smol"].state == "unloaded"  # a timeout may pass: not marked failed
        pool.load_timeout = 120
        assert pool.load_now("smol").state == "loaded"
    finally:
        pool.close()


def test_preload_and_idle_unload(tmp_path_factory):
    with models_server(tmp_path_factory, "--model", f"smol={SMOL}", "--preload", "smol",
                       "--idle-unload-s", "1") as server:
        log = server.output()  # loaded before the workers started (its state may be idle-unloaded now)
        assert -1 < log.find("model 'smol' loaded in") < log.find("Uvicorn running"), log
        wait_until(lambda: server.state("smol") == "unloaded", 10, "smol to unload once idle")
        r = server.post("/v1/completions", PROMPT)  # the one model: `model` may be left out
        assert r.status_code == 200 and r.json()["model"] == "smol", r.text
