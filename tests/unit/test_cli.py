"""The command line: every engine option has a help line, and vLLM's spellings mean ours."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from unison import cli
from unison.config import HELP, EngineConfig
from unison.model.weights.loader import default_gguf_path


def test_every_engine_option_has_one_line_of_help():
    not_options = {"model_repo", "model_commit"}  # set when a Hugging Face id is resolved
    assert set(HELP) == {f.name for f in fields(EngineConfig)} - not_options
    assert all(text and "\n" not in text for text in HELP.values())
    text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "default: None" not in text


def test_vllm_spellings_parse_to_ours():
    args = cli.build_parser().parse_args(
        ["serve", "some/model", "--max-model-len", "512", "--api-server-count", "2"])
    assert (args.model, args.context_length, args.tokenizer_worker_num) == ("some/model", 512, 2)
    args = cli.build_parser().parse_args(["serve", "--model", "other/model"])
    assert args.model_path == ["other/model"] and args.model is None  # (serve: NAME=PATH, repeated)
    args = cli.build_parser().parse_args(["generate", "hi", "--model", "other/model"])
    assert cli.engine_options(args)["model_path"] == "other/model"


@pytest.mark.parametrize("argv, message", [
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["serve", "a/model", "--model", "b/model"], "the model is given twice"),
    (["serve", "--models-max", "0"], "--models-max must be >= 1"),
    (["serve", "--preload", "a", "--models-max", "2"], "--models-max, --preload: for several models"),
    (["serve", "--model", "a=/no/such.gguf"], "model 'a': path '/no/such.gguf' does not exist"),
    (["serve", "--model", f"a={default_gguf_path()}", "b/model"], "each is given as --model NAME=PATH"),
    (["serve", "--model", f"a={default_gguf_path()}", "--served-model-name", "x"], "--served-model-name"),
    (["serve", "--model", f"a={default_gguf_path()}", "--preload", "b"], "--preload ['b']: not among"),
])
def test_serve_refuses_clearly(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_options_page_is_made_from_the_parser():
    """docs/options.md is `unison options`' output: regenerate it when an option changes."""
    page = Path(__file__).resolve().parents[2] / "docs" / "options.md"
    assert page.read_text() == cli.options_markdown(), "run: unison options > docs/options.md"
    row = "| `--max-running-requests` | requests decoded together at most (default: 64) |"
    assert row in page.read_text()
