"""`make device-check` (unison/bench/device_check.py) where no GPU is: it stops at once saying so
(its other checks run in-process: tests/unit/test_device_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "unison" / "bench" / "device_check.py"


def test_without_cuda_it_stops_at_once_and_says_why(tmp_path: Path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    env = {**os.environ, "DEVICE": "cuda", "OUT": str(tmp_path)}
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    figures = (tmp_path / "device_check.txt").read_text()
    assert "torch sees no CUDA device" in figures and "DEVICE=cpu" in figures
    assert figures.splitlines()[-1] in run.stdout  # the same lines on the terminal
    assert not (tmp_path / ".device").exists()  # nothing installed before the device was checked
