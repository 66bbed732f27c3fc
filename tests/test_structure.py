"""The tree's import rules, its class sizes, and that frontend processes never load torch or
transformers.

The rules keep the layers apart: the frontend knows the wire's messages, not the core; the core
knows no frontend; the wire knows neither; only the CLI and the deployment start a server; no HTTP
API imports another; no module imports one that imports it back. A frontend that imported torch
would take seconds and hundreds of MiB to start, and every HTTP worker is one.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "unison"
# Modules that run in frontend processes (the Engine's owner, attached Engines, HTTP workers).
FRONTEND_SIDE = ["unison/__init__.py", "unison/config.py", "unison/sampling.py", "unison/version.py",
                 "unison/errors.py", "unison/json_types.py", "unison/api", "unison/wire", "unison/frontend",
                 "unison/server", "unison/deploy"]
# Every folder of the package: a layer (tests/test_structure.py holds each to its rules).
LAYERS = {"api", "wire", "frontend", "frontend/text", "core", "core/kv", "model", "model/csrc", "server",
          "server/pipeline", "server/apis", "server/ui", "deploy", "bench", "bench/data"}
HEAVY = ("torch", "transformers")
MAX_CLASS_LINES = 300  # a class past this holds more than one concept: split it along a seam


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at module level) for each import in a file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, id(node) in top))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: resolve it
            base = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
            module = ".".join(base + ((node.module,) if node.module else ()))
            found.append((module, id(node) in top))
    return found


def _files(*where: str) -> list[Path]:
    out = []
    for w in where:
        p = ROOT / w
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def _violations(files: list[Path], banned: tuple[str, ...], module_level_only: bool = False) -> list[str]:
    bad = []
    for f in files:
        for module, top in _imports(f):
            if module_level_only and not top:
                continue
            if any(module == b or module.startswith(b + ".") for b in banned):
                bad.append(f"{f.relative_to(ROOT)} imports {module}")
    return bad


def test_every_folder_is_a_known_layer():
    """A new folder is a new layer: add it to LAYERS, with its rules here and its line in
    docs/architecture.md."""
    apis = PACKAGE / "server" / "apis"  # one folder per API: test_no_http_api_imports_another's
    folders = {str(d.relative_to(PACKAGE)) for d in PACKAGE.rglob("*") if d.is_dir()
               and "__pycache__" not in d.parts and d.parent != apis}
    assert folders == LAYERS
    documented = (ROOT / "docs" / "architecture.md").read_text()
    assert [f for f in sorted(LAYERS) if f"unison/{f}/" not in documented] == []


def test_frontend_imports_nothing_from_core_model_server_or_deploy():
    banned = ("unison.core", "unison.model", "unison.server", "unison.deploy", "unison.api")
    assert _violations(_files("unison/frontend"), banned) == []


def test_core_imports_nothing_from_frontend_server_or_deploy():
    banned = ("unison.frontend", "unison.server", "unison.deploy", "unison.api")
    assert _violations(_files("unison/core"), banned) == []


def test_the_wire_imports_no_layer_that_uses_it():
    banned = ("unison.frontend", "unison.core", "unison.model", "unison.server", "unison.deploy",
              "unison.api")
    assert _violations(_files("unison/wire"), banned) == []


def test_only_the_cli_and_the_deployment_import_the_server():
    outside = [f for f in _files("unison") if not f.is_relative_to(PACKAGE / "server")
               and not f.is_relative_to(PACKAGE / "deploy") and f != PACKAGE / "cli.py"]
    assert _violations(outside, ("unison.server",)) == []


def test_no_http_api_imports_another():
    """Each API is one folder over the pipeline: none reads another's bodies or JSON."""
    apis = [d for d in (PACKAGE / "server" / "apis").iterdir() if (d / "__init__.py").exists()]
    assert {d.name for d in apis} >= {"openai", "anthropic", "ollama", "llama_server", "sglang"}
    others = {d: tuple(f"unison.server.apis.{o.name}" for o in apis if o != d) for d in apis}
    bad = [v for d in apis for v in _violations(_files(str(d.relative_to(ROOT))), others[d])]
    assert bad == []


def test_no_module_level_torch_or_transformers_on_the_frontend_side():
    assert _violations(_files(*FRONTEND_SIDE), HEAVY, module_level_only=True) == []


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports, anywhere in the file (a
    function's import and a TYPE_CHECKING one count too). `from a import b` is an edge to a.b when
    that is a module, else to a; importing a.b.c also runs the packages a and a.b, except those
    the importer is itself inside (they ran first)."""
    files = {_module(p): p for p in _files("unison")}
    graph = {}
    for name, path in files.items():
        own = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        targets, edges = set(), set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = path.relative_to(ROOT).with_suffix("").parts[: -node.level] if node.level else ()
                module = ".".join((*base, *([node.module] if node.module else [])))
                targets |= {f"{module}.{a.name}" if f"{module}.{a.name}" in files else module
                            for a in node.names}
        for target in targets:
            while target and target not in files:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            parents = {target.rsplit(".", i)[0] for i in range(1, target.count(".") + 1)}
            edges |= ({target} | (parents - own)) & set(files)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it (the first again at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt):
                return cycle
        path.pop()
        done.add(node)
        return None

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_no_class_over_the_limit_anywhere():
    big = [f"{f.relative_to(ROOT)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
           for f in _files("unison")
           for node in ast.parse(f.read_text()).body
           if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


def test_find_cycle_finds_one_through_a_package_face():
    graph = {"unison": {"unison.api.engine"}, "unison.api.engine": {"unison.wire.messages"},
             "unison.wire.messages": {"unison"}, "unison.cli": {"unison"}}
    assert find_cycle(graph) == ["unison", "unison.api.engine", "unison.wire.messages", "unison"]
    assert find_cycle(graph | {"unison.wire.messages": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert {"unison.api.engine", "unison.version"} <= graph["unison"]  # the face is read too
    assert "unison.server.errors" in graph["unison.server.apis.sglang.routes"]
    assert find_cycle(graph) is None


# ---- at run time ------------------------------------------------------------------------------

WATCH = """
import os, sys
log = os.environ.get("UNISON_TEST_IMPORT_LOG")
if log:
    class _Watch:
        def find_spec(self, name, path=None, target=None):
            if name in ("torch", "transformers"):
                with open(os.path.join(log, str(os.getpid())), "a") as f:
                    f.write(name + "\\n")
            return None
    sys.meta_path.insert(0, _Watch())
"""

SCRIPT = """
import multiprocessing as mp, os, subprocess, sys, time
import httpx
from unison import Engine

def attached(parent):
    e = Engine.attach_tokenizer_worker(parent)
    assert e.generate("Hi", {"max_new_tokens": 2})["output_ids"]
    e.shutdown()

if __name__ == "__main__":
    cores = []
    with Engine(tokenizer_worker_num=2, num_threads=1) as engine:
        assert engine.generate("Hi", {"max_new_tokens": 2})["output_ids"]
        cores.append(engine.get_server_info()["core_pid"])
        p = mp.get_context("spawn").Process(target=attached, args=(os.getpid(),))
        p.start(); p.join(60)
        assert p.exitcode == 0
    port = int(sys.argv[1])
    server = subprocess.Popen([sys.executable, "-m", "unison.cli", "serve", "--port", str(port),
                               "--tokenizer-worker-num", "2", "--num-threads", "1"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                info = httpx.get(url + "/get_server_info", timeout=2).json()
                if len(info["frontends"]) == 2:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.2)
        for _ in range(4):  # both workers, most likely
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
        cores.append(info["core_pid"])
        workers = [fe["pid"] for fe in info["frontends"]]
    finally:
        server.terminate()
        server.wait(30)
    print("CORES", *cores)
    print("FRONTENDS", os.getpid(), p.pid, server.pid, *workers)
"""


@pytest.mark.timeout(300)
def test_frontend_processes_never_import_torch_or_transformers(tmp_path: Path):
    """The owner, an attached Engine, the server's launcher and its HTTP workers: none of them
    imports torch or transformers at any point; only the cores do."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WATCH)
    log = tmp_path / "imports"
    log.mkdir()
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "UNISON_TEST_IMPORT_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, str(script), str(port)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line[:5] in ("CORES", "FRONT"))
    cores = set(lines["CORES"].split())
    frontends = set(lines["FRONTENDS"].split())
    importers = {p.name: p.read_text().split() for p in log.iterdir()}
    assert cores <= set(importers), "the watch saw no core import torch: it does not work"
    assert {pid: mods for pid, mods in importers.items() if pid in frontends} == {}
    assert len(frontends) == 5  # the owner, the attached child, the launcher, two HTTP workers
