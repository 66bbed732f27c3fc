"""Models named by their Hugging Face id, through the whole engine, against the stand-in Hub
(tests/hub.py): `Engine(model_path="owner/name:TAG")` serves what the local file serves and says
where it came from; `unison serve owner/name` serves it under that name; a name that resolves to
nothing is refused before any process starts. (Which files are taken: tests/unit/test_hub.py.)"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub import StandInHub, point_at
from tests.serving import serve
from tests.unit.test_model import split_gguf, tiny_model
from tests.utils import HTTP
from unison import Engine
from unison.model.weights.loader import default_gguf_path, resolve_model_dir

PARAMS = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture()
def stand_in(monkeypatch, tmp_path: Path):
    with StandInHub() as server:
        point_at(monkeypatch, server.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # the launcher's cache: this test's
        server.cache = str(tmp_path / "hf-cache")
        yield server


def test_an_engine_named_by_a_gguf_repository_serves_the_file_and_says_whence(stand_in: StandInHub,
                                                                             tmp_path: Path):
    gguf = default_gguf_path()
    commit = stand_in.add("org/SmolLM2-GGUF", {"SmolLM2-135M-Instruct-Q4_1.gguf": gguf.read_bytes(),
                                               "README.md": b"# the embedded model"})
    split_gguf(gguf, tmp_path, max_tensors=100)  # the same model in parts, as big models come
    stand_in.add("org/Split-GGUF", {p.name.replace("model-", "SmolLM2-Q4_1-"): p.read_bytes()
                                    for p in tmp_path.glob("model-*.gguf")})
    with Engine(model_path=str(gguf), num_threads=1) as local:
        want = local.generate("The capital of France is", PARAMS)["output_ids"]
    with Engine(model_path="org/SmolLM2-GGUF:q4_1", download_dir=stand_in.cache, num_threads=1) as named:
        assert named.generate("The capital of France is", PARAMS)["output_ids"] == want
        info = named.get_server_info()
    assert info["model_repo"] == "org/SmolLM2-GGUF:q4_1" and info["model_commit"] == commit
    assert Path(info["model_path"]).name == "SmolLM2-135M-Instruct-Q4_1.gguf"
    with Engine(model_path="org/Split-GGUF:Q4_1", download_dir=stand_in.cache, num_threads=1) as split:
        assert split.generate("The capital of France is", PARAMS)["output_ids"] == want
        assert Path(split.get_server_info()["model_path"]).name.startswith("SmolLM2-Q4_1-00001-of-")


def test_serve_names_the_model_as_the_user_did(stand_in: StandInHub, tmp_path: Path):
    folder = tmp_path / "tiny"
    tiny_model("qwen3-qk-norm", folder, vocab_size=49152)
    for f in resolve_model_dir(None).iterdir():  # the embedded model's tokenizer, to run it
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    commit = stand_in.add("org/tiny-qwen3", {p.name: p.read_bytes() for p in folder.iterdir()})
    with contextlib.contextmanager(serve)("hub", "org/tiny-qwen3", "--download-dir", stand_in.cache,
                                          "--quiet") as server:
        models = HTTP.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["org/tiny-qwen3"]
        info = HTTP.get(server.url + "/get_server_info").json()
        assert info["model_repo"] == "org/tiny-qwen3" and info["model_commit"] == commit
        r = HTTP.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "org/tiny-qwen3"


def test_a_name_that_resolves_to_nothing_is_refused_before_anything_starts(stand_in: StandInHub):
    run = subprocess.run([sys.executable, "-m", "unison.cli", "serve", "org/nothing-here"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "unison: error: org/nothing-here: no such path here, and no repository 'org/nothing-here'" \
        in run.stderr
    asked = [p for _, p, _ in stand_in.requests if p.startswith("/api/models")]
    assert asked == ["/api/models/org/nothing-here/revision/main"]  # once; no core was started


def test_a_tokenizer_from_another_repository(stand_in: StandInHub, tmp_path: Path):
    """SGLang's tokenizer_path as an id: a model folder with no tokenizer serves with another
    repository's (the core's grammar and the frontends' files come from there)."""
    folder = tmp_path / "bare"
    tiny_model("qwen3-qk-norm", folder, vocab_size=49152, eos_token_id=2)  # the tokenizer's <|im_end|>
    tokenizer = {f.name: f.read_bytes() for f in resolve_model_dir(None).iterdir()
                 if f.name.startswith(("tokenizer", "special_tokens"))}
    stand_in.add("org/tokenizer-only", {**tokenizer, "README.md": b"# just a tokenizer"})
    assert not (folder / "tokenizer.json").exists()  # alone, the model could not start
    with Engine(model_path=str(folder), tokenizer_path="org/tokenizer-only", download_dir=stand_in.cache,
                num_threads=1) as engine:
        out = engine.generate("Hi", {"max_new_tokens": 8, "json_schema": {"type": "object"}})
        assert out["text"].startswith("{")  # the grammar read the other repository's vocabulary
        local = Path(engine.get_server_info()["tokenizer_path"])
    assert (local / "tokenizer.json").read_bytes() == tokenizer["tokenizer.json"]
