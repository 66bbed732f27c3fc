"""ServeSettings: `unison serve`'s own flags, declared once.

The command line's flags are made from the fields (`add_serve_options`), the launcher takes one
ServeSettings (launch.py), and every HTTP worker gets it, with where its core is, as
WorkerSettings (JSON in its environment). The engine's options are EngineConfig's (config.py).
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, fields

import msgspec

from unison.compat import SERVE_ALIASES
from unison.config import option

ROUTINGS = ("least_loaded", "prefix", "kv")  # how a worker picks a replica (deploy/replicas.py)


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """`unison serve`'s own options, each with its help (the engine's are EngineConfig's)."""

    host: str = option("127.0.0.1", "interface to listen on")
    port: int = option(30000, "port to listen on")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (/health and /metrics stay open)")
    served_model_name: str | None = option(None, "the model's name in the API (default: its file or folder "
                                                 "name)")
    tool_call_parser: str | None = option(None, "how tool_choice \"auto\" reads calls in the model's text: "
                                                "hermes (Qwen2.5/3, alias qwen25), llama3_json (alias llama3)"
                                                " or qwen3_coder (Qwen3-Coder, Qwen3.5's XML calls)")
    generation_config: str = option("auto", "request defaults: auto (the model's generation_config.json), "
                                            "vllm (none) or a folder holding one; its max_new_tokens caps "
                                            "every request")
    chat_template: str | None = option(None, "a Jinja chat template (a file, or the template itself) over the"
                                             " model's")
    max_request_bytes: int | None = option(None, "largest request body; past it: 413, unread (default: "
                                                 "4 MiB + 64 bytes a token of the model's context; 32 MiB "
                                                 "with --models-dir)")
    data_parallel_size: int = option(1, "engine cores behind one address, each in a Ray actor (needs "
                                        "unison[ray])")
    ray_address: str | None = option(None, "an existing Ray cluster for the replicas (left running); default:"
                                           " a local Ray instance, started and stopped with the server")
    routing: str = option("least_loaded", "which replica takes a request: least_loaded (engine-wide, from the"
                                          " replicas' load reports), prefix (a hash of the prompt's first "
                                          "characters) or kv (the most of the prompt's blocks cached, from "
                                          "the replicas' KV events, weighed against load)")
    disable_ui: bool = option(False, "no web page at / (chat, and the engine with its frontends)")
    extra_frontends: int = option(0, "frontends that may attach beside the HTTP workers, e.g. an Engine in "
                                     "another process: Engine.attach_tokenizer_worker(<server pid>)")
    enable_auto_tool_choice: bool = option(False, "vLLM's flag, accepted: tool_choice \"auto\" works "
                                                  "whenever a parser is set")
    models_dir: str | None = option(None, "serve every model in this folder (each .gguf file, and each folder"
                                          " with a config.json, named by its file or folder name), each on "
                                          "its own engine core started on first use; --model NAME=PATH "
                                          "(repeatable) adds one")
    models_max: int = option(4, "several models: engine cores loaded at once; past it the least recently used"
                                " idle one is stopped")
    idle_unload_s: float | None = option(None, "several models: stop a model's core after this many seconds "
                                               "without requests (default: never)")
    preload: tuple[str, ...] = option((), "several models: load these at start")
    model_load_timeout: float = option(600.0, "several models: how long a request waits for its model to load"
                                              " (seconds)")

    @property
    def data_parallel(self) -> bool:
        return self.data_parallel_size > 1 or self.ray_address is not None

    def check(self) -> None:
        """Refuse what cannot serve, naming the flag, before anything starts."""
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.extra_frontends < 0:
            raise ValueError(f"--extra-frontends must be >= 0, got {self.extra_frontends}")
        if self.extra_frontends and self.data_parallel:
            raise ValueError("--extra-frontends is for one engine: data-parallel cores take frontends "
                             "over TCP only")
        if self.routing not in ROUTINGS:
            raise ValueError(f"--routing must be one of {list(ROUTINGS)}, got {self.routing!r}")
        if self.models_max < 1:
            raise ValueError(f"--models-max must be >= 1, got {self.models_max}")
        if self.idle_unload_s is not None and self.idle_unload_s <= 0:
            raise ValueError(f"--idle-unload-s must be > 0, got {self.idle_unload_s}")
        if self.model_load_timeout <= 0:
            raise ValueError(f"--model-load-timeout must be > 0, got {self.model_load_timeout}")
        if self.tool_call_parser is not None:
            from unison.frontend.text.tool_parsers import get_parser

            get_parser(self.tool_call_parser)  # an unknown name fails here, not at the first request

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        return cls(**{**values, "preload": tuple(values["preload"])})


HELP = {f.name: f.metadata['help'] for f in fields(ServeSettings) if 'help' in f.metadata}
CHOICES = {"routing": ROUTINGS}


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """One --flag per ServeSettings field."""
    hints = typing.get_type_hints(ServeSettings)
    for f in fields(ServeSettings):
        flags = [f"--{f.name.replace('_', '-')}", *SERVE_ALIASES.get(f.name, [])]
        if hints[f.name] is bool:
            parser.add_argument(*flags, dest=f.name, action="store_true", help=HELP[f.name])
            continue
        kind = next(t for t in (int, float, str) if t in typing.get_args(hints[f.name]) or hints[f.name] is t)
        many = "+" if typing.get_origin(hints[f.name]) is tuple else None
        default = "" if f.default in (None, ()) else f" (default: {f.default})"
        parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, choices=CHOICES.get(f.name),
                            nargs=many, help=HELP[f.name] + default)


@dataclass(frozen=True)
class WorkerSettings:
    """What the launcher hands each HTTP worker."""

    serve: ServeSettings
    served_model_name: str  # resolved: --served-model-name, else the model's file or folder name
    registry_path: str  # the core's registry (one engine)
    owner_pid: int
    replicas_path: str | None = None  # data parallel: the launcher's replicas file (replicas.ReplicaSet)
    pool_endpoint: str | None = None  # several models: the launcher's model pool (model_pool.py)
    models: tuple[str, ...] = ()  # ... and their names

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> WorkerSettings:
        return msgspec.json.decode(text, type=cls)
