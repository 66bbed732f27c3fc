"""Models named by their Hugging Face id, against a stand-in Hub (tests/hub.py) that huggingface_hub
itself talks to: which files are taken from a safetensors or a GGUF repository, revisions, gated
repositories, offline use with and without the cache, a download resumed, and what is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from tests.hub import StandInHub, point_at
from unison import cli
from unison.api import hub
from unison.config import EngineConfig

CONFIG = b'{"architectures": ["Qwen3ForCausalLM"]}'
SAFETENSORS_REPO = {
    "config.json": CONFIG, "generation_config.json": b"{}", "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}", "chat_template.jinja": b"{{ messages }}", "README.md": b"# tiny",
    "additional_chat_templates/tool_use.jinja": b"{{ tools }}",
    "model.safetensors.index.json": b'{"weight_map": {"a": "model-00001-of-00002.safetensors", '
                                    b'"b": "model-00002-of-00002.safetensors"}}',
    "model-00001-of-00002.safetensors": b"1" * 1000, "model-00002-of-00002.safetensors": b"2" * 1000,
    "original/consolidated.00.pth": b"x" * 500, "consolidated.safetensors": b"y" * 500,
    "pytorch_model.bin": b"z" * 500,
}
GGUF_REPO = {
    "Tiny-Q4_K_M.gguf": b"GGUF-q4km", "Tiny-Q8_0.gguf": b"GGUF-q8", "Tiny-IQ4_XS.gguf": b"GGUF-iq4",
    "Q2_K/Tiny-Q2_K-00001-of-00002.gguf": b"GGUF-part1", "Q2_K/Tiny-Q2_K-00002-of-00002.gguf": b"GGUF-part2",
    "mmproj-Tiny-f16.gguf": b"GGUF-mmproj", "README.md": b"# tiny",
}


@pytest.fixture()
def stand_in(monkeypatch, tmp_path: Path):
    """The stand-in Hub as huggingface_hub's endpoint, online, with no token; downloads into a
    cache of the test's own."""
    with StandInHub() as server:
        point_at(monkeypatch, server.url)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        server.cache = str(tmp_path / "hf-cache")
        yield server


def _locate(server: StandInHub, name: str, **kwargs) -> hub.Located:
    return hub.locate(name, download_dir=server.cache, quiet=True, **kwargs)


def test_names_and_paths_are_told_apart(tmp_path: Path, monkeypatch):
    assert hub.is_repo_id("Qwen/Qwen3-0.6B") and hub.is_repo_id("bartowski/Qwen_Qwen3-0.6B-GGUF:Q4_K_M")
    assert hub.is_repo_id("org/model@v1.0") and hub.is_repo_id("org/model:q8_0@0123abc")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not hub.is_repo_id("org/model")  # a folder that exists is a path
    assert not hub.is_repo_id("./org/model") and not hub.is_repo_id("/models/x")
    assert not hub.is_repo_id("model") and not hub.is_repo_id("a/b/c")
    assert hub.gguf_tag("Q2_K/Tiny-Q2_K-00001-of-00002.gguf") == "Q2_K"
    assert hub.gguf_tag("qwen2.5-0.5b-instruct-q4_k_m.gguf") == "Q4_K_M"


def test_a_safetensors_repository_gives_what_serving_reads(stand_in: StandInHub):
    commit = stand_in.add("org/tiny", SAFETENSORS_REPO)
    found = _locate(stand_in, "org/tiny")
    assert found.commit == commit and found.repo == "org/tiny" and found.path.is_dir()
    assert sorted(found.files) == sorted(["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                          "model-00002-of-00002.safetensors", "config.json",
                                          "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                          "chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
    on_disk = sorted(p.relative_to(found.path).as_posix() for p in found.path.rglob("*") if p.is_file())
    assert on_disk == sorted(found.files)  # no README, no original/, consolidated* or *.bin
    assert (found.path / "model-00002-of-00002.safetensors").read_bytes() == b"2" * 1000


def test_every_file_the_tokenizer_reads_is_taken():
    """The frontends' tokenizer files (model/weights/loader.py) are among what a download takes."""
    from unison.model.weights.loader import TOKENIZER_FILES

    assert set(TOKENIZER_FILES) <= hub.SERVING_FILES


def test_a_gguf_repository_gives_the_tagged_file_its_parts_and_the_projector(stand_in: StandInHub):
    stand_in.add("org/Tiny-GGUF", GGUF_REPO)
    default = _locate(stand_in, "org/Tiny-GGUF")
    assert default.files == ("Tiny-Q4_K_M.gguf", "mmproj-Tiny-f16.gguf")  # Q4_K_M first, any case
    assert default.path.name == "Tiny-Q4_K_M.gguf" and default.path.read_bytes() == b"GGUF-q4km"
    assert _locate(stand_in, "org/Tiny-GGUF:q8_0").path.read_bytes() == b"GGUF-q8"
    split = _locate(stand_in, "org/Tiny-GGUF:Q2_K")
    assert split.files[:2] == ("Q2_K/Tiny-Q2_K-00001-of-00002.gguf", "Q2_K/Tiny-Q2_K-00002-of-00002.gguf")
    assert split.path.read_bytes() == b"GGUF-part1"
    assert (split.path.parent / "Tiny-Q2_K-00002-of-00002.gguf").read_bytes() == b"GGUF-part2"
    with pytest.raises(ValueError, match=r"no GGUF file tagged IQ1_S: the tags found are "
                                         r"\['IQ4_XS', 'Q2_K', 'Q4_K_M', 'Q8_0'\]"):
        _locate(stand_in, "org/Tiny-GGUF:IQ1_S")
    stand_in.add("org/Odd-GGUF", {"Odd-IQ4_XS.gguf": b"GGUF", "Odd-F16.gguf": b"GGUF"})
    with pytest.raises(ValueError, match=r"no GGUF file tagged Q4_K_M / Q4_K_S / Q4_0 / Q8_0; name one: "
                                         r"the tags found are \['F16', 'IQ4_XS'\] \(as org/Odd-GGUF:TAG\)"):
        _locate(stand_in, "org/Odd-GGUF")


def test_a_revision_is_honoured(stand_in: StandInHub):
    old = stand_in.add("org/tiny", {**SAFETENSORS_REPO, "config.json": b'{"v": 1}'}, ref="v1")
    new = stand_in.add("org/tiny", SAFETENSORS_REPO)
    assert _locate(stand_in, "org/tiny@v1").commit == old
    assert (_locate(stand_in, "org/tiny", revision="v1").path / "config.json").read_bytes() == b'{"v": 1}'
    assert _locate(stand_in, "org/tiny").commit == new
    assert _locate(stand_in, f"org/tiny@{old}").commit == old
    with pytest.raises(FileNotFoundError, match="org/tiny@v9: the repository has no revision 'v9'"):
        _locate(stand_in, "org/tiny@v9")


def test_a_gated_repository_needs_a_token(stand_in: StandInHub, monkeypatch):
    stand_in.add("org/gated", SAFETENSORS_REPO, token="secret")
    with pytest.raises(PermissionError, match="org/gated: the repository is gated .* set HF_TOKEN"):
        _locate(stand_in, "org/gated")
    monkeypatch.setenv("HF_TOKEN", "secret")
    assert _locate(stand_in, "org/gated").path.is_dir()


def test_offline_uses_the_cache_and_says_when_it_cannot(stand_in: StandInHub, monkeypatch):
    stand_in.add("org/Tiny-GGUF", GGUF_REPO)
    online = _locate(stand_in, "org/Tiny-GGUF:Q8_0")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    asked = len(stand_in.requests)
    offline = _locate(stand_in, "org/Tiny-GGUF:Q8_0")
    assert offline.path == online.path and offline.commit == online.commit
    assert len(stand_in.requests) == asked  # the Hub was not asked
    with pytest.raises(ValueError, match="no GGUF file tagged Q4_K_M"):  # only what the cache holds
        _locate(stand_in, "org/Tiny-GGUF:Q4_K_M")
    with pytest.raises(FileNotFoundError, match="org/other: offline .* no revision 'main' of org/other: "
                                                "run `unison pull org/other`"):
        _locate(stand_in, "org/other")


def test_an_interrupted_download_is_resumed(stand_in: StandInHub, monkeypatch):
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 100)  # what arrived is kept chunk by chunk
    stand_in.add("org/tiny", SAFETENSORS_REPO)
    stand_in.cut_after["model-00001-of-00002.safetensors"] = 300
    found = _locate(stand_in, "org/tiny")
    assert (found.path / "model-00001-of-00002.safetensors").read_bytes() == b"1" * 1000
    ranges = [r for method, path, r in stand_in.requests
              if method == "GET" and path.endswith("model-00001-of-00002.safetensors")]
    assert ranges == [None, "bytes=300-"]  # the second request asked only for the rest


def test_what_cannot_run_is_refused_naming_what_was_found(stand_in: StandInHub):
    stand_in.add("org/pickles", {"config.json": CONFIG, "pytorch_model.bin": b"z", "README.md": b"#"})
    with pytest.raises(ValueError, match=r"org/pickles: nothing Unison can run: it reads GGUF files or "
                                         r"safetensors beside a config.json, and the repository holds "
                                         r"\['.bin', '.json', '.md'\]"):
        _locate(stand_in, "org/pickles")
    with pytest.raises(FileNotFoundError, match="org/missing: no such path here, and no repository "
                                                "'org/missing' on the Hub"):
        _locate(stand_in, "org/missing")
    with pytest.raises(ValueError, match=r"org/pickles:Q4_K_M: :Q4_K_M names a GGUF file"):
        _locate(stand_in, "org/pickles:Q4_K_M")


def test_the_config_is_located_once_with_its_commit(stand_in: StandInHub):
    commit = stand_in.add("org/Tiny-GGUF", GGUF_REPO)
    config = EngineConfig(model_path="org/Tiny-GGUF:Q8_0", download_dir=stand_in.cache)
    located = hub.locate_config(config, quiet=True)
    assert located.model_repo == "org/Tiny-GGUF:Q8_0" and located.model_commit == commit
    assert Path(located.model_path).read_bytes() == b"GGUF-q8"
    assert hub.locate_config(located) is located  # a local path: as it is
    local = EngineConfig(model_path=str(Path(located.model_path)))
    assert hub.locate_config(local) is local


def test_pull_and_models_on_the_command_line(stand_in: StandInHub, capsys):
    stand_in.add("org/Tiny-GGUF", GGUF_REPO)
    stand_in.add("org/tiny", SAFETENSORS_REPO)
    stand_in.add("org/pickles", {"config.json": CONFIG, "pytorch_model.bin": b"z"})
    assert cli.main(["pull", "org/Tiny-GGUF:Q4_K_M", "--download-dir", stand_in.cache, "--quiet"]) == 0
    assert capsys.readouterr().out.strip().endswith("Tiny-Q4_K_M.gguf")
    assert cli.main(["pull", "org/tiny", "--download-dir", stand_in.cache]) == 0
    out = capsys.readouterr()
    assert "org/tiny: taking model.safetensors.index.json" in out.err and "downloading config.json" in out.err
    assert cli.main(["pull", "org/pickles", "--download-dir", stand_in.cache]) == 2
    assert "unison: error: org/pickles: nothing Unison can run" in capsys.readouterr().err
    assert cli.main(["models", "--download-dir", stand_in.cache]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows] == ["org/Tiny-GGUF", "org/tiny"]
    assert rows[0].endswith("gguf: Q4_K_M") and rows[1].endswith("safetensors")


def test_a_tokenizer_named_by_its_id_is_taken_alone(stand_in: StandInHub):
    """SGLang's tokenizer_path, given as an id: its tokenizer and config files, never its weights."""
    stand_in.add("org/tiny", SAFETENSORS_REPO)
    config = EngineConfig(model_path="/models/local.gguf", tokenizer_path="org/tiny",
                          download_dir=stand_in.cache)
    located = hub.locate_config(config, quiet=True)
    folder = Path(located.tokenizer_path)
    assert located.model_path == "/models/local.gguf" and located.model_repo is None
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
    stand_in.add("org/no-tokenizer", {"config.json": CONFIG, "model.safetensors": b"w"})
    with pytest.raises(ValueError, match="org/no-tokenizer: no tokenizer"):
        hub.locate_config(dataclasses.replace(config, tokenizer_path="org/no-tokenizer"), quiet=True)


def test_a_download_reports_its_progress_to_the_model_pool(stand_in: StandInHub, monkeypatch):
    """What the web page shows while a pool model named by its id loads: the share downloaded."""
    from unison.deploy.model_pool import ModelSource, _Slot

    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 250)
    stand_in.add("org/tiny", SAFETENSORS_REPO)
    heard: list[tuple[int, int]] = []
    found = hub.locate("org/tiny", download_dir=stand_in.cache, quiet=True,
                       progress=lambda done, total: heard.append((done, total)))
    total = sum(len(SAFETENSORS_REPO[f]) for f in found.files)
    assert {t for _, t in heard} == {total} and heard[-1] == (total, total)
    assert [d for d, _ in heard] == sorted(d for d, _ in heard) and len(heard) > 8  # chunk by chunk
    slot = _Slot(ModelSource("tiny", "org/tiny"), 0, "generate", state="loading", progress=0.42)
    assert slot.row().progress == 0.42
    slot.state = "loaded"
    assert slot.row().progress is None


def test_several_models_take_hub_names_loaded_on_first_use():
    """`--model NAME=owner/name`: accepted as it is (it is downloaded when first asked for)."""
    from unison.deploy.model_pool import ModelSource, find_models

    assert find_models(None, ["tiny=org/tiny:Q4_K_M"]) == [ModelSource("tiny", "org/tiny:Q4_K_M")]
    with pytest.raises(FileNotFoundError, match="model 'x': path './missing' does not exist"):
        find_models(None, ["x=./missing"])


def test_an_unreachable_hub_falls_back_to_the_cache(stand_in: StandInHub, monkeypatch):
    stand_in.add("org/Tiny-GGUF", GGUF_REPO)
    online = _locate(stand_in, "org/Tiny-GGUF")
    point_at(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    assert _locate(stand_in, "org/Tiny-GGUF").path == online.path
    with pytest.raises(FileNotFoundError, match=r"org/other: offline \(HF_HUB_OFFLINE=1, or the Hub "
                                                r"unreachable\)"):
        _locate(stand_in, "org/other")
