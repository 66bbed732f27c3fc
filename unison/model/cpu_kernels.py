"""C kernels for CPU inference, compiled on first use and loaded with ctypes.

Torch has no paged decode attention for CPUs: its path gathers each request's blocks into a padded
copy and runs SDPA over it, which reads the K/V bytes three times. The kernel in csrc/ reads them
once, through the block table. It is plain C (no torch headers), so building it takes about a
second; the shared object is cached under ~/.cache/unison/kernels keyed by the source, the
compiler flags and the CPU's feature flags. Without a C compiler, or with UNISON_CPU_KERNELS=0,
`load()` returns None and the runner keeps torch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_lib: ctypes.CDLL | None | bool = False  # False: not tried yet


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (the caller falls back)."""
    global _lib
    if _lib is False:
        _lib = None
        if os.environ.get("UNISON_CPU_KERNELS", "1") != "0":
            try:
                _lib = _bind(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("CPU attention kernel unavailable (%s): using torch's path", e)
    return _lib


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode() + _cpu_flags())
    root = Path(os.environ.get("UNISON_CACHE_DIR", Path.home() / ".cache" / "unison")) / "kernels"
    target = root / f"decode_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(out, target)
    log.info("built %s", target)
    return target


def _cpu_flags() -> bytes:
    # -march=native code must not be reused on a CPU with other instructions (a shared home dir).
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                     ctypes.c_float, ctypes.c_int]
    lib.decode_attention.restype = ctypes.c_int
    return lib


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, window: int | None,
                     num_threads: int) -> torch.Tensor:
    """out [seqs, heads, head_dim] = softmax(q K^T / sqrt(d)) V over each sequence's cached tokens.

    q [seqs, heads, d]; caches [blocks, block_size, kv_heads, d]; block_tables [seqs, width] and
    context_lens [seqs] int64. Every tensor float32 / int64, contiguous, on CPU.
    """
    seqs, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    for t in (q, k_cache, v_cache, block_tables, context_lens):
        assert t.is_contiguous() and t.device.type == "cpu", "kernel inputs must be contiguous CPU tensors"
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
    assert block_tables.dtype == context_lens.dtype == torch.int64
    out = torch.empty_like(q)
    rc = lib.decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(), seqs, heads, kv_heads, d,
        block_size, window or 0, d ** -0.5, num_threads)
    if rc != 0:
        raise MemoryError("decode attention kernel: out of memory")
    return out
