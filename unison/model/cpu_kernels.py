"""C kernels for CPU inference, compiled on first use and loaded with ctypes.

Torch has no paged decode attention for CPUs: its path gathers each request's blocks into a padded
copy and runs SDPA over it, which moves the K/V bytes three times. csrc/decode_attention.c reads
them once, through the block table. csrc/fused_ops.c does each of the model's small per-layer
operations (residual add + RMSNorm, rotary embedding, the KV-cache write) in one call instead of
several torch ops, which at decode batch sizes cost more in dispatch than in arithmetic.

The sources are plain C (no torch headers), so building takes about a second; the shared object
is cached under ~/.cache/unison/kernels, keyed by the sources, the compiler flags and the CPU's
feature flags. Without a C compiler, or with UNISON_CPU_KERNELS=0, `load()` returns None and
the model runs on torch ops alone (the reference path, tested beside this one).
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

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("decode_attention.c", "fused_ops.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]

_loaded: CpuKernels | None | bool = False  # False: not tried yet


def load() -> CpuKernels | None:
    """The compiled kernels, or None where they cannot be built here (callers fall back)."""
    global _loaded
    if _loaded is False:
        _loaded = None
        if os.environ.get("UNISON_CPU_KERNELS", "1") != "0":
            try:
                _loaded = CpuKernels(ctypes.CDLL(str(build())))
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("CPU kernels unavailable (%s): using torch ops", e)
    return _loaded


def build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES))
    key.update(" ".join([cc, *FLAGS]).encode() + _cpu_flags())
    root = Path(os.environ.get("UNISON_CACHE_DIR", Path.home() / ".cache" / "unison")) / "kernels"
    target = root / f"unison-cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
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


_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuKernels:
    """Typed entry points. Every tensor is float32 (int64 for indices) on CPU, and its rows are
    contiguous; callers guarantee both (the model and runner build them that way)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.decode_attention.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                         _I64, _I64, _I64, _F32, _INT]
        lib.decode_attention.restype = _INT
        lib.add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT]
        lib.add_rms_norm.restype = None
        lib.rope.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _INT]
        lib.rope.restype = None
        lib.store_kv.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64]
        lib.store_kv.restype = None

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, window: int | None,
                         num_threads: int) -> torch.Tensor:
        """out [seqs, heads, d] = softmax(q K^T / sqrt(d)) V over each sequence's cached tokens.

        q [seqs, heads, d] contiguous; caches [blocks, block_size, kv_heads, d] (one layer);
        block_tables [seqs, width] and context_lens [seqs] int64 contiguous.
        """
        seqs, heads, d = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.is_contiguous() and block_tables.dtype == context_lens.dtype == torch.int64
        out = torch.empty_like(q)
        rc = self.lib.decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(), seqs, heads, kv_heads, d,
            block_size, window or 0, d ** -0.5, num_threads)
        if rc != 0:
            raise MemoryError("decode attention kernel: out of memory")
        return out

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """h += delta in place (when given); returns rms_norm(h) * weight. h, delta: [rows, dim]."""
        out = torch.empty_like(h)
        self.lib.add_rms_norm(h.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(), h.shape[0],
                              h.shape[1], eps, torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates, in place, the `heads` heads at the start of each row of x (rows may be strided:
        q and k inside the fused QKV output). cos, sin: [rows, head_dim / 2] contiguous."""
        assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        self.lib.rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], heads,
                      head_dim, torch.get_num_threads())

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """Cache rows `slots` (of [slots, kv_heads * d]) = the rows of k and v, which share a row
        stride (both live in the fused QKV output)."""
        assert k.stride() == v.stride() and k.stride(-1) == 1 and slots.dtype == torch.int64
        width = k.shape[1]
        self.lib.store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), k.shape[0], width)
