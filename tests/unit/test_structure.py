"""The tree's layers, import rules and class sizes, read from the source (that frontend processes
never load torch or transformers, on real processes: tests/e2e/test_frontend_imports.py).

The rules keep the layers apart: the frontend knows the wire's messages, not the core; the core
knows no frontend; the wire knows neither; only the CLI and the deployment start a server; no HTTP
API imports another; no module imports one that imports it back. A frontend that imported torch
would take seconds and hundreds of MiB to start, and every HTTP worker is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "unison"
# Modules that run in frontend processes (the Engine's owner, attached Engines, HTTP workers).
FRONTEND_SIDE = ["unison/__init__.py", "unison/config.py", "unison/sampling.py", "unison/version.py",
                 "unison/errors.py", "unison/json_types.py", "unison/api", "unison/wire", "unison/frontend",
                 "unison/server", "unison/deploy"]
# Every folder of the package: a layer (the tests below hold each to its rules).
LAYERS = {"api", "wire", "frontend", "frontend/text", "core", "core/kv", "model", "model/layers",
          "model/weights", "model/vision", "model/pooling", "model/kernels", "model/kernels/csrc", "server",
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
