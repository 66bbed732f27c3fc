"""Command line: `unison generate | serve | bench`."""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path

from unison.api.hub import locate_config
from unison.compat import ENGINE_ALIASES
from unison.config import HELP, EngineConfig
from unison.server.settings import ServeSettings, add_serve_options

QUIET_HELP = "no download progress and fewer log lines"
_SERVE_OWN = {"model_path", "tokenizer_worker_num"}  # spelled out by each command
MODELS_OPTIONS = ("models_max", "idle_unload_s", "preload", "model_load_timeout")  # serve's, several models


def add_engine_options(parser: argparse.ArgumentParser, many_models: bool = False) -> None:
    """One --flag per EngineConfig field, so the CLI never falls behind the config. `many_models`:
    `--model NAME=PATH` may be repeated (`unison serve`'s several models)."""
    group = parser.add_argument_group("engine options")
    if many_models:
        group.add_argument("--model-path", *ENGINE_ALIASES["model_path"], action="append", default=None,
                           help=HELP["model_path"] + "; NAME=PATH, repeated: serve several models")
    else:
        group.add_argument("--model-path", *ENGINE_ALIASES["model_path"], default=None,
                           help=HELP["model_path"])
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name in _SERVE_OWN or "help" not in f.metadata:  # (not an option: set by the engine)
            continue
        flags = [f"--{f.name.replace('_', '-')}", *ENGINE_ALIASES.get(f.name, [])]
        if hints[f.name] is bool:
            group.add_argument(*flags, action="store_const", const=True, default=None, help=HELP[f.name])
            continue
        kind = next(t for t in (int, float, str) if t in typing.get_args(hints[f.name]) or hints[f.name] is t)
        many = "+" if typing.get_origin(hints[f.name]) is tuple else None
        default = "" if f.default in (MISSING, None, ()) else f" (default: {f.default})"
        group.add_argument(*flags, dest=f.name, type=kind, default=None, help=HELP[f.name] + default,
                           nargs=many)


def engine_options(args: argparse.Namespace) -> dict[str, typing.Any]:  # Any: each option's own type
    opts = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
            if f.name not in _SERVE_OWN and getattr(args, f.name, None) is not None}
    return {"model_path": args.model_path, **opts}


def _generate(args: argparse.Namespace) -> int:
    from unison import Engine

    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.seed is not None:
        params["sampling_seed"] = args.seed
    opts = engine_options(args) | ({"log_level": "error"} if args.quiet else {})
    with Engine(**opts) as engine:
        prompt, ids = args.prompt, None
        if args.chat:  # the template writes its own special tokens: no second BOS
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            prompt, ids = None, engine.tokenizer.encode(text, add_special_tokens=False)
        if not args.stream:
            out = engine.generate(prompt, params, input_ids=ids)
            assert isinstance(out, dict)  # one prompt: one result
            print(out["text"])
            return 0
        shown = 0
        chunks = engine.generate(prompt, params, input_ids=ids, stream=True)
        assert isinstance(chunks, Iterator)
        for chunk in chunks:
            sys.stdout.write(chunk["text"][shown:])
            sys.stdout.flush()
            shown = len(chunk["text"])
        sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from unison.deploy.launch import serve

    settings = ServeSettings.from_args(args)
    settings.check()
    if settings.data_parallel:
        from unison.deploy.data_parallel import import_ray

        import_ray()  # not installed: say what to install, before anything starts
    paths = [*(args.model_path or []), *([args.model] if args.model is not None else [])]
    named = [p for p in paths if _is_named(p)]
    if named or settings.models_dir is not None:
        return _serve_models(args, settings, paths, named)
    if given := [f"--{f.replace('_', '-')}" for f in MODELS_OPTIONS
                 if getattr(settings, f) != getattr(ServeSettings(), f)]:
        raise ValueError(f"{', '.join(given)}: for several models (--models-dir or --model NAME=PATH)")
    if len(set(paths)) > 1:
        raise ValueError(f"the model is given twice: {paths}; several models are given as --model NAME=PATH")
    args.model_path = paths[0] if paths else None
    return serve(_serve_config(args), settings)


def _serve_models(args: argparse.Namespace, settings: ServeSettings, paths: list[str],
                  named: list[str]) -> int:
    from unison.deploy.launch import serve_models
    from unison.deploy.model_pool import find_models

    if plain := [p for p in paths if p not in named]:
        raise ValueError(f"with several models each is given as --model NAME=PATH: {plain}")
    if settings.data_parallel or settings.served_model_name is not None:
        raise ValueError("several models take their names from --model NAME=PATH or their files: "
                         "--served-model-name and --data-parallel-size are for one model")
    args.model_path = None
    return serve_models(_serve_config(args), settings, find_models(settings.models_dir, named))


def _is_named(value: str) -> bool:
    """`NAME=PATH` (one of several models) rather than a path that holds a '='."""
    name, eq, _ = value.partition("=")
    return bool(eq) and "/" not in name and not Path(value).expanduser().exists()


def _serve_config(args: argparse.Namespace) -> EngineConfig:
    opts = engine_options(args)
    if opts.get("skip_tokenizer_init"):
        raise ValueError("--skip-tokenizer-init is for the Python Engine: the server's routes "
                         "tokenize and detokenize")
    opts.setdefault("log_level", "info")
    config = EngineConfig.from_kwargs(tokenizer_worker_num=args.tokenizer_worker_num, **opts)
    return locate_config(config, quiet=args.quiet)  # a Hugging Face id, resolved before anything starts


def _pull(args: argparse.Namespace) -> int:
    from unison.api.hub import locate

    found = locate(args.name, args.revision, args.download_dir, args.quiet)
    print(found.path)
    return 0


def _models(args: argparse.Namespace) -> int:
    from unison.api.hub import cached_models

    rows = cached_models(args.download_dir)
    if not rows:
        print("no model Unison can run is in the Hugging Face cache (unison pull NAME brings one)")
    for row in rows:
        print(f"{row.repo:48s} {row.size / 2**30:8.2f} GiB  {row.kind}")
    return 0


def _serve_arguments(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("model", nargs="?", default=None, help="the model (as --model-path)")
    srv.add_argument("--tokenizer-worker-num", "--api-server-count", type=int, default=1,
                     help="HTTP worker processes, each a frontend of the one engine core")
    srv.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    add_serve_options(srv)
    add_engine_options(srv, many_models=True)


def options_markdown() -> str:
    """docs/options.md: `unison serve`'s options, made from the same declarations as its parser
    (tests/unit/test_cli.py keeps the file current)."""
    parser = argparse.ArgumentParser(prog="unison serve", add_help=False)
    _serve_arguments(parser)
    rows = [f"| {', '.join(f'`{s}`' for s in a.option_strings)} | {(a.help or '').replace('|', '/')} |"
            for a in parser._actions if a.option_strings]
    return ("# Options\n\n`unison serve`'s flags, made by `unison options`. Every engine option is also a "
            "keyword argument of\n`Engine(...)`, its name in underscores (`--max-running-requests` is "
            "`max_running_requests`).\n\n| flag | what it does |\n|---|---|\n" + "\n".join(rows) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unison", description="Unison LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    add_engine_options(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _serve_arguments(srv)
    srv.set_defaults(func=_serve)

    pull = sub.add_parser("pull", help="download a Hugging Face model (owner/name[:TAG][@revision]) "
                                       "without serving it; print its local path")
    pull.add_argument("name")
    pull.add_argument("--revision", default=None, help=HELP["revision"])
    pull.add_argument("--download-dir", default=None, help=HELP["download_dir"])
    pull.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    pull.set_defaults(func=_pull)

    models = sub.add_parser("models", help="the models in the Hugging Face cache that Unison can run, "
                                           "with their sizes")
    models.add_argument("--download-dir", default=None, help=HELP["download_dir"])
    models.set_defaults(func=_models)

    options = sub.add_parser("options", help="every option of `unison serve` as a Markdown table "
                                             "(docs/options.md)")
    options.set_defaults(func=lambda args: print(options_markdown(), end="") or 0)

    from unison.bench import (
        activations,
        bandwidth,
        compare,
        embed,
        frontend,
        kernels,
        kv_events,
        long,
        lora,
        lora_runner,
        model,
        multi_model,
        offline,
        prefix,
        ray_hop,
        serve,
        soak,
        speculative,
        vision,
        weight_update,
    )

    bench = sub.add_parser("bench", help="benchmarks (figures, beside a baseline)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    offline.add_parser(bench_sub)
    embed.add_parser(bench_sub)
    frontend.add_parser(bench_sub)
    prefix.add_parser(bench_sub)
    long.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    multi_model.add_parser(bench_sub)
    soak.add_parser(bench_sub)
    model.add_parser(bench_sub)
    kernels.add_parser(bench_sub)
    bandwidth.add_parser(bench_sub)
    activations.add_parser(bench_sub)
    speculative.add_parser(bench_sub)
    lora.add_parser(bench_sub)
    lora_runner.add_parser(bench_sub)
    compare.add_parser(bench_sub)
    kv_events.add_parser(bench_sub)
    weight_update.add_parser(bench_sub)
    ray_hop.add_parser(bench_sub)
    vision.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, PermissionError, ConnectionRefusedError) as e:
        print(f"unison: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
