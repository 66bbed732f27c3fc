"""C kernels for CPU inference, compiled on first use and loaded with ctypes.

Torch has no paged attention for CPUs: its path gathers each request's blocks into a padded copy
and runs SDPA over it, which moves the K/V bytes three times and sums in an order that depends on
the batch's shapes. csrc/paged_attention.c reads them once, through the block table, and computes
every row the same way whatever else is in the batch. csrc/quant_linear.c runs int4 / int8
linears (see model/weights/quant.py). csrc/fused_ops.c does each of the model's small per-layer
operations (residual add + RMSNorm, rotary embedding, the KV-cache write) in one call instead of
several torch ops, which at decode batch sizes cost more in dispatch than in arithmetic.
csrc/lora.c adds LoRA adapters' updates to a linear's output, each row with its own adapter.
csrc/moe.c runs a mixture of experts' MLP: routing, the experts grouped by the rows they got.
csrc/gated_delta.c runs the Gated DeltaNet layers' convolution and recurrence over each request's
state (Qwen3-Next, Qwen3.5). csrc/bandwidth.c measures the memory's read speed, the bound of a
decode step. csrc/image_attention.c runs a vision tower's attention over an image's patches in
bfloat16 dot products (AVX-512 BF16), twice torch's float32 rate.

The sources are plain C (no torch headers), compiled side by side on a machine's first use (about
10 s of CPU, 7 s on two cores); the shared object is cached under ~/.cache/unison/kernels, keyed
by the sources, the compiler flags and the CPU's feature flags. Without a C compiler, or with
UNISON_CPU_KERNELS=0, `load()` returns None and the model runs on torch ops alone (the reference
path, tested beside this one).

The quantized linears have one path per instruction set (AVX2, AVX-512 VNNI, AMX), chosen at run
time by what the CPU reports, and giving the same bits on each. UNISON_QUANT_KERNEL=avx2|vnni|amx
forces one (tests compare them; an unsupported one is an error, not a silent fallback).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from unison.model.layers.key_rounding import KeyRounding
from unison.model.weights.disk_cache import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention.c", "fused_ops.c", "quant_linear.c", "decoder.c",
                                    "lora.c", "moe.c", "gated_delta.c", "bandwidth.c", "image_attention.c")]
HEADERS = [CSRC / "paged_attention_body.h", CSRC / "q8.h", CSRC / "simd_math.h", CSRC / "lora.h",
           CSRC / "moe.h", CSRC / "gguf_blocks.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-std=c11"]

@functools.cache  # built and loaded once, on first use
def load() -> CpuKernels | None:
    """The compiled kernels, or None where they cannot be built here (callers fall back)."""
    if os.environ.get("UNISON_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable (%s): using torch ops", e)
        return None
    check_struct_layout(lib)
    return CpuKernels(lib)


def build(defines: tuple[str, ...] = ()) -> Path:
    """The shared object, built once per source, flags and CPU. `defines`: extra -D macros (the
    tests' QL_AMX_EMULATE build)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    flags = [*FLAGS, *(f"-D{d}" for d in defines)]
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS))
    key.update(" ".join([cc, *flags]).encode() + _cpu_flags())
    root = cache_root() / "kernels"
    target = root / f"unison-cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One build at a time per folder (the processes of a first start all want it: one compiles,
    # the others wait and load it), beside the target and renamed: no one loads a half-written file.
    with _locked(root):
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                _compile(cc, flags, Path(tmp), target)
            log.info("built %s", target)
    return target


def _compile(cc: str, flags: list[str], tmp: Path, target: Path) -> None:
    """Each source to an object at once (two of them are most of the time), then one link."""
    objects = [tmp / f"{i}.o" for i in range(len(SOURCES))]
    procs = []
    try:
        for src, obj in zip(SOURCES, objects):
            with open(obj.with_suffix(".err"), "w") as err:  # a file: no pipe to fill and stall on
                procs.append(subprocess.Popen([cc, *flags, "-c", str(src), "-o", str(obj)],
                                              stdout=subprocess.DEVNULL, stderr=err))
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # a compiler past its time: gone with the build
                p.kill()
                p.wait()
    errors = [obj.with_suffix(".err").read_text() or f"exit status {code}"
              for obj, code in zip(objects, codes) if code != 0]
    out = tmp / target.name
    if not errors:
        link = subprocess.run([cc, *flags, "-shared", *map(str, objects), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
        errors = [link.stderr] if link.returncode != 0 else []
    if errors:
        raise OSError(f"{cc} failed: {errors[0].strip()[-500:]}")
    os.replace(out, target)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` itself (flock on its descriptor: no lock file left behind)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


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


# as act_mul and mul_act number them; swiglu_oai: gpt-oss's clamped SwiGLU (act_mul only)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "sigmoid": 2, "swiglu_oai": 3}
# The quantized kernels' instruction-set paths, as quant_linear.c numbers them, slowest first.
QUANT_PATHS = {"portable": 0, "avx2": 1, "vnni": 2, "amx": 3}
# The KV cache's element types, as the kernels number them.
# The cache's element types; int8 is in llama.cpp's q8_0 blocks (csrc/paged_attention.c).
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3, torch.float8_e4m3fn: 4,
             torch.float8_e5m2: 5}
C_ONLY_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # torch's attention reads none


@dataclass(frozen=True, slots=True)
class DeltaStep:
    """Which rows of a step are whose, for the linear-attention layers: request i has rows
    [row_start[i], row_start[i] + row_count[i]) and state slot slots[i] (int64 tensors)."""

    slots: torch.Tensor
    row_start: torch.Tensor
    row_count: torch.Tensor


@dataclass(frozen=True, slots=True)
class ImageRows:
    """A step's rows that are images' (vision/encoder.py): their embeddings replace their tokens', and
    each row of the step sees `ahead` keys past its own position (an image's whole image)."""

    rows: torch.Tensor  # [R] int64, rows of the flat step
    values: torch.Tensor  # [R, hidden] float32
    ahead: torch.Tensor  # [N] int64, every row of the step (0: causal)
    deepstack: tuple[torch.Tensor, ...] = ()  # [R, hidden] each: added after text layer 0, 1, ...


@dataclass(slots=True)
class Recent:
    """An int8 cache's recent rows for one layer's store and attention (csrc/q8.h): the keys and
    values of a query's own block are read as float16. `rows_k` / `rows_v` [rows, kv_heads * d]
    take the step's rows; `twins_k` / `twins_v` [twins, block_size, kv_heads, d] the blocks that
    requests continue mid-way, row `twin_slots[r]` taking row r (-1: none); per request,
    `first_row` is its first row in the step and `twin` the twin of that row's block (-1: none)."""

    rows_k: torch.Tensor
    rows_v: torch.Tensor
    twins_k: torch.Tensor
    twins_v: torch.Tensor
    twin_slots: torch.Tensor
    first_row: torch.Tensor
    twin: torch.Tensor

    def c(self) -> RecentRowsC:
        return RecentRowsC(self.rows_k.data_ptr(), self.rows_v.data_ptr(), self.twins_k.data_ptr(),
                           self.twins_v.data_ptr(), self.first_row.data_ptr(), self.twin.data_ptr())


class RecentRowsC(ctypes.Structure):
    _fields_ = [("k", _PTR), ("v", _PTR), ("k_twins", _PTR), ("v_twins", _PTR), ("first_row", _PTR),
                ("twin", _PTR)]


class CpuKernels:
    """Typed entry points. Tensors are float32 (int64 for indices; the KV cache float32, float16
    or bfloat16) on CPU, and their rows are contiguous; callers guarantee both (the model and
    runner build them that way)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._scratch = torch.empty(0, dtype=torch.uint8)  # quantized activations, reused
        lib.paged_attention.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                                        _I64, _I64, _I64, _F32, _INT, _INT, _PTR, _PTR, _PTR, _PTR]
        lib.paged_attention.restype = _INT
        lib.add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT]
        lib.add_rms_norm.restype = None
        lib.rope.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _INT]
        lib.rope.restype = None
        lib.rope_partial.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT]
        lib.rope_partial.restype = None
        lib.gated_delta.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                                    _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _PTR, _INT]
        lib.gated_delta.restype = None
        lib.row_gates.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR]
        lib.row_gates.restype = None
        lib.mul_act.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _INT]
        lib.mul_act.restype = None
        lib.delta_gates.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR]
        lib.delta_gates.restype = None
        lib.store_kv.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR,
                                 _PTR, _PTR, _PTR, _PTR]
        lib.store_kv.restype = None
        lib.act_mul.argtypes = [_PTR, _PTR, _I64, _I64, _INT, _INT]
        lib.act_mul.restype = None
        lib.norm_groups.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _F32]
        lib.norm_groups.restype = None
        lib.quantize_act16.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
        lib.quantize_act16.restype = None
        lib.act16_bytes.argtypes = [_I64, _I64]
        lib.act16_bytes.restype = _I64
        lib.quant_linear_parts.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                                           _PTR, _I64, _INT]
        lib.quant_linear_parts.restype = None
        lib.dequantize_columns.argtypes = [_I64, _PTR, _I64, _I64, _PTR, _I64, _PTR]
        lib.dequantize_columns.restype = None
        lib.lora_apply.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _INT]
        lib.lora_apply.restype = None
        lib.moe_forward.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _INT]
        lib.moe_forward.restype = None
        lib.moe_workspace_bytes.argtypes = [_PTR, _I64]
        lib.moe_workspace_bytes.restype = _I64
        lib.moe_route.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR]
        lib.moe_route.restype = None
        self._moe_scratch = torch.empty(0, dtype=torch.uint8)
        lib.decoder_workspace_bytes.argtypes = [_PTR, _I64]
        lib.decoder_workspace_bytes.restype = _I64
        lib.decoder_forward.argtypes = [_PTR, _PTR]
        lib.decoder_forward.restype = _INT
        lib.read_memory.argtypes, lib.read_memory.restype = [_PTR, _I64, _INT], ctypes.c_uint64
        lib.image_attention.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _F32, _INT]
        lib.image_attention.restype = _INT
        for name in ("quant_kernel_best", "quant_kernel_path", "quant_kernel_amx_refused"):
            getattr(lib, name).argtypes, getattr(lib, name).restype = [], _INT
        lib.quant_kernel_select.argtypes, lib.quant_kernel_select.restype = [_INT], _INT
        self.select_quant_path(os.environ.get("UNISON_QUANT_KERNEL", "auto"))

    def supported_quant_paths(self) -> list[str]:
        """The quantized paths this build and CPU can run, slowest first."""
        current = self.lib.quant_kernel_path()
        paths = [name for name, n in QUANT_PATHS.items() if self.lib.quant_kernel_select(n) == n]
        self.lib.quant_kernel_select(current)
        return paths

    def select_quant_path(self, name: str) -> None:
        """Run quantized linears on `name` (a QUANT_PATHS key, or auto: the fastest supported)."""
        if name == "auto":
            self.lib.quant_kernel_select(self.lib.quant_kernel_best())
            refused = self.lib.quant_kernel_amx_refused()
            if refused:
                log.warning("this CPU has AMX but the kernel refused its tile state (%s): quantized "
                            "linears run on AVX-512 VNNI", os.strerror(refused))
            return
        if name not in QUANT_PATHS:
            raise ValueError(f"UNISON_QUANT_KERNEL={name!r}: expected auto or one of {sorted(QUANT_PATHS)}")
        if self.lib.quant_kernel_select(QUANT_PATHS[name]) < 0:
            raise ValueError(f"UNISON_QUANT_KERNEL={name!r}: this CPU or build cannot run it "
                             f"(it can: {', '.join(self.supported_quant_paths())})")

    def image_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                        ) -> torch.Tensor | None:
        """softmax(q k^T * scale) v over all of an image's patches, q, k, v [n, heads, d] float32
        (contiguous), in bfloat16 dot products with float32 sums (csrc/image_attention.c); None
        where this CPU has no AVX-512 BF16 (or d > 128): the caller runs torch's."""
        n, heads, d = q.shape
        assert q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype == torch.float32
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        done = self.lib.image_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, heads,
                                        d, heads * d, scale, torch.get_num_threads())
        return out if done == 0 else None

    @property
    def quant_path(self) -> str:
        """The quantized path in use."""
        number = self.lib.quant_kernel_path()
        return next(name for name, n in QUANT_PATHS.items() if n == number)

    def kinds(self, weights) -> str:
        """What quant.QuantWeights run as: int4 / int8 / a mix, with the instruction-set path
        (e.g. int4/vnni, int4/amx+int8/amx)."""
        return "+".join(dict.fromkeys(f"{w.kind}/{self.quant_path}" for w in weights))

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor,
                        window: int | None, num_threads: int, scale: float | None = None,
                        key_mean: torch.Tensor | None = None, recent: Recent | None = None,
                        sinks: torch.Tensor | None = None,
                        row_ahead: torch.Tensor | None = None) -> torch.Tensor:
        """out [rows, heads, d]: row r = softmax(q_r K^T * scale) V over the first row_len[r] tokens
        (the last `window` of them) of request row_seq[r]; an int8 cache's recent rows from `recent`.
        `sinks` [heads] float32: a learned logit per head in the softmax's denominator (gpt-oss).
        `row_ahead` [rows] int64: keys past its own position each row also sees (an image's).

        q [rows, heads, d] float32 contiguous; caches [blocks, block_size, kv_heads, d] (one layer,
        any of KV_DTYPES); block_tables [requests, width], row_seq and row_len [rows] int64.
        key_mean: the layer's KeyRounding mean [kv_heads, d] that store_kv took (int8).
        """
        rows, heads, d = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.is_contiguous() and block_tables.dtype == row_len.dtype == torch.int64
        out = torch.empty_like(q)
        rows_c = None if recent is None else recent.c()
        rc = self.lib.paged_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], row_seq.data_ptr(), row_len.data_ptr(), out.data_ptr(), rows, heads,
            kv_heads, d, block_size, window or 0, d ** -0.5 if scale is None else scale, num_threads,
            KV_DTYPES[k_cache.dtype], _ptr(key_mean), None if rows_c is None else ctypes.addressof(rows_c),
            _ptr(sinks), _ptr(row_ahead))
        if rc != 0:
            raise MemoryError("paged attention kernel: out of memory")
        return out

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """h += delta in place (when given); returns rms_norm(h) * weight. h, delta: [rows, dim]."""
        out = torch.empty_like(h)
        self.lib.add_rms_norm(h.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(), h.shape[0],
                              h.shape[1], eps, torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates, in place, the first cos.shape[1] * 2 dims (all of head_dim, or a part) of the
        `heads` heads at the start of each row of x (rows may be strided: q and k inside the
        fused QKV output). cos, sin: [rows, rotated dims / 2] contiguous."""
        assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        self.lib.rope_partial(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], heads,
                              head_dim, 2 * cos.shape[1], torch.get_num_threads())

    def row_gates(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sigmoid(x . w) per row of x [rows, dim] (rows may be strided), summed in order: [rows]."""
        assert x.stride(1) == 1 and w.is_contiguous() and x.shape[1] == w.numel()
        out = torch.empty(x.shape[0])
        self.lib.row_gates(x.data_ptr(), x.stride(0), w.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def mul_act_(self, x: torch.Tensor, gate: torch.Tensor, activation: str) -> None:
        """x *= act(gate) in place, x and gate [rows, n] (rows may be strided); act: silu | sigmoid."""
        assert x.stride(1) == 1 and gate.stride(1) == 1 and x.shape == gate.shape
        self.lib.mul_act(x.data_ptr(), x.stride(0), gate.data_ptr(), gate.stride(0), x.shape[0], x.shape[1],
                         ACTIVATIONS[activation], torch.get_num_threads())

    def delta_gates(self, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                    neg_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A Gated DeltaNet's (g, beta) [rows, heads] from its a and b projections (same strides)."""
        assert a.stride() == b.stride() and a.stride(1) == 1
        g, beta = torch.empty(a.shape), torch.empty(a.shape)
        self.lib.delta_gates(a.data_ptr(), b.data_ptr(), a.stride(0), a.shape[0], a.shape[1],
                             dt_bias.data_ptr(), neg_a.data_ptr(), g.data_ptr(), beta.data_ptr())
        return g, beta

    def gated_delta(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                    conv_state: torch.Tensor, rec_state: torch.Tensor, step: DeltaStep,
                    tiled: bool = False) -> torch.Tensor:
        """A Gated DeltaNet layer's convolution and recurrence (csrc/gated_delta.c) on x [rows,
        conv_dim] (q|k|v, rows may be strided), g and beta [rows, value heads] (same strides),
        over this layer's states conv_state [slots, K-1, conv_dim] and rec_state
        [slots, value heads, dk, dv], updated in place: [rows, value heads * dv]. `tiled`: value
        head h reads key head h % key heads (else h // (value heads / key heads))."""
        assert x.stride(1) == 1 and g.stride() == beta.stride() and g.stride(1) == 1
        assert conv_state.is_contiguous() and rec_state.is_contiguous() and conv_weight.is_contiguous()
        rows, (hv, dk, dv) = x.shape[0], rec_state.shape[1:]
        hk = (x.shape[1] - hv * dv) // (2 * dk)
        work = torch.empty(rows, x.shape[1])
        out = torch.empty(rows, hv * dv)
        self.lib.gated_delta(x.data_ptr(), x.stride(0), g.data_ptr(), beta.data_ptr(), g.stride(0),
                             conv_weight.data_ptr(), conv_weight.shape[1], conv_state.data_ptr(),
                             rec_state.data_ptr(), step.slots.data_ptr(), step.row_start.data_ptr(),
                             step.row_count.data_ptr(), len(step.slots), hk, hv, dk, dv, int(tiled),
                             work.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    def norm_groups_(self, x: torch.Tensor, groups: int, dim: int, weight: torch.Tensor, eps: float) -> None:
        """RMS norm, in place, of `groups` groups of `dim` at the start of each row of x (rows may be
        strided: q or k inside the fused QKV output)."""
        assert x.stride(1) == 1 and weight.is_contiguous()
        self.lib.norm_groups(x.data_ptr(), x.stride(0), x.shape[0], groups, dim, weight.data_ptr(), eps)

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up for gate_up [rows, 2 n] contiguous: [rows, n]. act: silu | gelu_tanh."""
        assert gate_up.is_contiguous()
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n)
        self.lib.act_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, ACTIVATIONS[activation],
                         torch.get_num_threads())
        return out

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, head_dim: int, key_weight: torch.Tensor | None = None,
                 key_mean: torch.Tensor | None = None, recent: Recent | None = None) -> None:
        """Cache rows `slots` (of [slots, kv_heads * head_dim]) = the rows of k and v, which share
        a row stride (both live in the fused QKV output). int8 rows go in rotated (fused_ops.c),
        keys less `key_mean` ([kv_heads, head_dim]) and rounded by `key_weight` ([kv_heads,
        head_dim, head_dim]) where given: one layer's KeyRounding (key_rounding.py); and into
        `recent`'s rows and twins as float16."""
        assert k.stride() == v.stride() and k.stride(-1) == 1 and slots.dtype == torch.int64
        width = k.shape[1]
        r = recent
        self.lib.store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), k.shape[0], width, head_dim, KV_DTYPES[k_cache.dtype],
                          _ptr(key_weight), _ptr(key_mean),
                          *((r.rows_k.data_ptr(), r.rows_v.data_ptr(), r.twins_k.data_ptr(),
                             r.twins_v.data_ptr(), r.twin_slots.data_ptr())
                            if r is not None else (None,) * 5))

    def act16(self, x: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' view of x [m, k]: its int16 values per 32-block [m, kp] and their scales
        [m, kp / 32] (x ~ q * scale, blockwise)."""
        m = x.shape[0]
        buf = torch.empty(self.lib.act16_bytes(m, kp), dtype=torch.uint8)
        self.lib.quantize_act16(x.data_ptr(), x.stride(0), m, x.shape[1], kp, buf.data_ptr(), 1)
        hi = buf[: m * kp].view(torch.int8).view(m, kp).to(torch.int32)
        lo = buf[m * kp: 2 * m * kp].view(m, kp).to(torch.int32)
        scales = buf[2 * m * kp: 2 * m * kp + 4 * m * (kp // 32)].view(torch.float32).view(m, kp // 32)
        return hi * 256 + lo, scales

    def quant_linear(self, x: torch.Tensor, plan: QuantPlan) -> torch.Tensor:
        """x [m, k] float32 (rows may be strided) @ W.T for the quantized parts in `plan`."""
        assert x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == plan.k
        m = x.shape[0]
        need = self.lib.act16_bytes(m, plan.kp)
        if self._scratch.numel() < need:  # grown, never shrunk: one forward runs at a time
            self._scratch = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(m, plan.out_cols)
        self.lib.quant_linear_parts(x.data_ptr(), x.stride(0), m, plan.k, plan.kp, plan.parts, plan.records,
                                    plan.weights, plan.n_padded, plan.offsets, self._scratch.data_ptr(),
                                    out.data_ptr(), plan.out_cols, torch.get_num_threads())
        return out if plan.out_cols == plan.n else out[:, : plan.n]

    def lora_apply(self, x: torch.Tensor, y: torch.Tensor, row_adapter: torch.Tensor, tables,
                   linear: int) -> None:
        """y[r] += the update of x[r] by adapter row_adapter[r] (-1: none) on linear `linear` of its
        table (lora.LoraStep builds `tables`). x, y float32 with contiguous rows (may be strided)."""
        assert x.dtype == y.dtype == torch.float32 and x.stride(1) == 1 and y.stride(1) == 1
        assert row_adapter.dtype == torch.int64 and row_adapter.numel() == x.shape[0] == y.shape[0]
        self.lib.lora_apply(x.data_ptr(), x.stride(0), x.shape[1], y.data_ptr(), y.stride(0), x.shape[0],
                            row_adapter.data_ptr(), tables, linear, torch.get_num_threads())

    def moe(self, x: torch.Tensor, layer: MoeLayerC) -> torch.Tensor:
        """The mixture of experts `layer` (moe.QuantMoe builds it) on x [rows, hidden] float32
        (rows contiguous, may be strided): [rows, hidden]."""
        assert x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == layer.hidden
        rows = x.shape[0]
        need = self.lib.moe_workspace_bytes(ctypes.byref(layer), rows)
        if self._moe_scratch.numel() < need:  # grown, never shrunk: one forward runs at a time
            self._moe_scratch = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(rows, layer.hidden)
        self.lib.moe_forward(ctypes.byref(layer), x.data_ptr(), x.stride(0), rows, out.data_ptr(),
                             layer.hidden, self._moe_scratch.data_ptr(), torch.get_num_threads())
        return out

    def moe_route(self, x: torch.Tensor, layer: MoeLayerC) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts [rows, top_k] (increasing) and weights the kernel routes x's rows to."""
        assert x.dtype == torch.float32 and x.stride(1) == 1
        top = torch.empty(x.shape[0], layer.top_k, dtype=torch.int32)
        weight = torch.empty(x.shape[0], layer.top_k)
        self.lib.moe_route(ctypes.byref(layer), x.data_ptr(), x.stride(0), x.shape[0], top.data_ptr(),
                           weight.data_ptr())
        return top, weight

    def dequantize_rows(self, weight, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows `ids` of a quant.QuantWeight (embedding lookups)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), weight.k)
        self.lib.dequantize_columns(weight.format, weight.packed.data_ptr(), weight.kp, weight.k,
                                    ids.data_ptr(), ids.numel(), out.data_ptr())
        return out


class QuantPlan:
    """A quantized linear's parts as the C entry point takes them, built once per layer (the
    ctypes arrays cost more to build than the call itself at batch 1)."""

    def __init__(self, parts: list) -> None:
        self.k, self.kp, self.n = parts[0].k, parts[0].kp, sum(p.n for p in parts)
        offsets = [sum(p.n for p in parts[:i]) for i in range(len(parts))]
        self.out_cols = offsets[-1] + parts[-1].n_padded  # room for the last part's padding
        arr = ctypes.c_int64 * len(parts)
        self.parts = len(parts)
        self.records = arr(*(p.format for p in parts))  # each part's format, as the kernel names it
        self.weights = arr(*(p.packed.data_ptr() for p in parts))
        self.n_padded = arr(*(p.n_padded for p in parts))
        self.offsets = arr(*offsets)
        self._keep = parts  # the packed tensors must outlive the pointers


# ---- the whole forward in one call (csrc/decoder.c) ---------------------------------------------

class QLinearC(ctypes.Structure):
    _fields_ = [("parts", _I64), ("records", _PTR), ("weights", _PTR), ("n_padded", _PTR), ("offsets", _PTR),
                ("k", _I64), ("kp", _I64), ("n", _I64), ("out_cols", _I64), ("bias", _PTR)]


class ExpertLinearC(ctypes.Structure):
    _fields_ = [("record", _I64), ("w", _PTR), ("n", _I64), ("k", _I64)]


class MoeLayerC(ctypes.Structure):
    _fields_ = [("experts", _I64), ("top_k", _I64), ("hidden", _I64), ("inter", _I64), ("norm_topk", _INT),
                ("activation", _INT), ("router", _PTR), ("gate", ExpertLinearC), ("up", ExpertLinearC),
                ("down", ExpertLinearC), ("router_bias", _PTR), ("gate_bias", _PTR), ("up_bias", _PTR),
                ("down_bias", _PTR)]


class DeltaLayerC(ctypes.Structure):
    _fields_ = [("in_proj", QLinearC), ("out_proj", QLinearC), ("order", _PTR), ("conv_w", _PTR),
                ("dt_bias", _PTR), ("neg_a", _PTR), ("norm", _PTR), ("conv_state", _PTR), ("rec_state", _PTR),
                ("k_heads", _I64), ("v_heads", _I64), ("k_dim", _I64), ("v_dim", _I64), ("conv_kernel", _I64),
                ("tiled", _INT)]


class SharedMlpC(ctypes.Structure):
    _fields_ = [("gate_up", QLinearC), ("down", QLinearC), ("gate", _PTR)]


class DLayerC(ctypes.Structure):
    _fields_ = [("qkv", QLinearC), ("o_proj", QLinearC), ("gate_up", QLinearC), ("down", QLinearC),
                ("input_norm", _PTR), ("post_attention_norm", _PTR), ("pre_mlp_norm", _PTR),
                ("post_mlp_norm", _PTR), ("q_norm", _PTR), ("k_norm", _PTR), ("rope", _I64), ("window", _I64),
                ("k_cache", _PTR), ("v_cache", _PTR), ("key_weight", _PTR), ("key_mean", _PTR),
                ("moe", ctypes.POINTER(MoeLayerC)), ("sinks", _PTR), ("delta", ctypes.POINTER(DeltaLayerC)),
                ("shared", ctypes.POINTER(SharedMlpC)), ("kv_layer", _I64)]


class DModelC(ctypes.Structure):
    _fields_ = [("layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("vocab", _I64), ("block_size", _I64), ("eps", _F32),
                ("attention_scale", _F32), ("embed_scale", _F32), ("activation", _INT), ("qk_norm", _INT),
                ("kv_dtype", _INT), ("output_gate", _INT), ("rotary_dim", _I64), ("embed_record", _I64),
                ("embed_kp", _I64), ("embed", _PTR), ("norm", _PTR), ("lm_head", QLinearC),
                ("layer", ctypes.POINTER(DLayerC))]


class DStepC(ctypes.Structure):
    _fields_ = [("rows", _I64), ("ids", _PTR), ("cos", ctypes.POINTER(_PTR)), ("sin", ctypes.POINTER(_PTR)),
                ("slots", _PTR), ("tables", _PTR), ("row_seq", _PTR), ("row_len", _PTR),
                ("table_stride", _I64), ("logit_rows", _I64), ("logit_index", _PTR), ("workspace", _PTR),
                ("logits", _PTR), ("num_threads", _INT), ("attention_threads", _INT), ("lora_row", _PTR),
                ("lora", _PTR), ("recent_k", _PTR), ("recent_v", _PTR), ("twin_k", _PTR), ("twin_v", _PTR),
                ("twin_layer", _I64), ("twin_slots", _PTR), ("first_row", _PTR), ("twin", _PTR),
                ("embed_count", _I64), ("embed_rows", _PTR), ("embed_values", _PTR), ("row_ahead", _PTR),
                ("state_items", _I64), ("state_slots", _PTR), ("state_start", _PTR), ("state_count", _PTR)]


def struct_mirrors() -> dict[str, type[ctypes.Structure]]:
    """The C structs the kernels take (by their C names) and their ctypes mirrors."""
    from unison.model.layers.lora import LoraLinearC, LoraPartC

    return {"QLinear": QLinearC, "ExpertLinear": ExpertLinearC, "MoeLayer": MoeLayerC,
            "DeltaLayer": DeltaLayerC, "SharedMlp": SharedMlpC, "DLayer": DLayerC, "DModel": DModelC,
            "DStep": DStepC, "RecentRows": RecentRowsC, "LoraPart": LoraPartC, "LoraLinear": LoraLinearC}


def check_struct_layout(lib: ctypes.CDLL) -> None:
    """Each ctypes mirror has its C struct's size, fields and offsets (csrc/decoder.c's
    struct_layout): a field added on one side only would otherwise be read at the wrong place."""
    lib.struct_layout.argtypes, lib.struct_layout.restype = [ctypes.c_char_p, _I64], _I64
    out = ctypes.create_string_buffer(1 << 14)
    assert lib.struct_layout(out, len(out)) < len(out)
    c = dict(entry.split("=") for entry in out.value.decode().split(";") if entry)
    wrong = []
    for name, mirror in struct_mirrors().items():
        ours = {f"{name}.{f[0]}": str(getattr(mirror, f[0]).offset) for f in mirror._fields_}
        ours[name] = str(ctypes.sizeof(mirror))
        theirs = {k: v for k, v in c.items() if k == name or k.startswith(name + ".")}
        wrong += [f"{k}: C {theirs.get(k)}, ctypes {ours.get(k)}" for k in sorted(ours.keys() | theirs.keys())
                  if ours.get(k) != theirs.get(k)]
    if wrong:
        raise RuntimeError(f"ctypes mirrors disagree with the C structs: {wrong}")


def _qlinear(plan: QuantPlan, bias: torch.Tensor | None) -> QLinearC:
    return QLinearC(plan.parts, ctypes.addressof(plan.records), ctypes.addressof(plan.weights),
                    ctypes.addressof(plan.n_padded), ctypes.addressof(plan.offsets), plan.k, plan.kp, plan.n,
                    plan.out_cols, _ptr(bias))


def _delta_layer(d, cfg, states, index: int) -> DeltaLayerC:
    """A linear_attention.DeltaNet as csrc/decoder.c takes it, over linear layer `index`'s states."""
    conv, rec = states.layer(index)
    return DeltaLayerC(_qlinear(d.in_proj.plan, d.in_proj.bias), _qlinear(d.out_proj.plan, d.out_proj.bias),
                       _ptr(d.order), d.conv_weight.data_ptr(), d.dt_bias.data_ptr(), d.neg_a.data_ptr(),
                       d.norm.data_ptr(), conv.data_ptr(), rec.data_ptr(), cfg.num_k_heads, cfg.num_v_heads,
                       cfg.head_k_dim, cfg.head_v_dim, cfg.conv_kernel, int(cfg.tiled))


QK_NORMS = {None: 0, "head": 1, "full": 2}
NORMS = ("input_norm", "post_attention_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm")


class CompiledDecoder:
    """A quantized decoder.DecoderModel and its KV cache as csrc/decoder.c takes them: a step's
    forward in one call (the model's Python forward calls the same kernels one by one). A hybrid's
    linear-attention layers run over `states` (linear_attention.DeltaStates), by slot."""

    def __init__(self, kernels: CpuKernels, model, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key_rounding: KeyRounding | None, states=None) -> None:
        cfg, self.kernels, self.model = model.cfg, kernels, model
        self.vocab = cfg.vocab_size
        layers = (DLayerC * len(model.layers))()
        parts: list[ctypes.Structure] = []  # the layers' own structs, kept alive with them
        for i, (layer, c) in enumerate(zip(model.layers, layers)):
            if layer.delta is not None:
                parts.append(_delta_layer(layer.delta, cfg.linear, states, model.linear_index[i]))
                c.delta = ctypes.pointer(parts[-1])
            else:
                kv = c.kv_layer = model.kv_index[i]
                c.qkv = _qlinear(layer.qkv.plan, layer.qkv.bias)
                c.o_proj = _qlinear(layer.o_proj.plan, layer.o_proj.bias)
                c.sinks, c.window = _ptr(layer.sinks), cfg.layer_window[i] or 0
                c.k_cache, c.v_cache = k_cache[kv].data_ptr(), v_cache[kv].data_ptr()
                if key_rounding is not None:
                    c.key_weight, c.key_mean = _ptr(key_rounding.weight[kv]), _ptr(key_rounding.mean[kv])
            if layer.moe is not None:
                c.moe = ctypes.pointer(layer.moe.c)
            else:
                c.gate_up, c.down = _qlinear(layer.gate_up.plan, None), _qlinear(layer.down.plan, None)
            if layer.shared is not None:
                sh = layer.shared
                parts.append(SharedMlpC(_qlinear(sh.gate_up.plan, None), _qlinear(sh.down.plan, None),
                                        sh.gate.data_ptr()))
                c.shared = ctypes.pointer(parts[-1])
            for name in NORMS:
                setattr(c, name, _ptr(getattr(layer, name)))
            c.rope = layer.rope
        head, embed = model.lm_head, model.embed.quant
        mlp = cfg.moe.intermediate_size if cfg.moe else cfg.intermediate_size  # sizes the dense buffers
        self.c = DModelC(
            len(model.layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, mlp, cfg.vocab_size, k_cache.shape[2], cfg.rms_norm_eps,
            cfg.attention_scale, model.embed_scale or 0.0, ACTIVATIONS[cfg.family.activation],
            QK_NORMS[cfg.family.qk_norm], KV_DTYPES[k_cache.dtype], int(cfg.family.attn_output_gate),
            cfg.rotary_dim or cfg.head_dim, embed.format, embed.kp, embed.packed.data_ptr(),
            model.norm.data_ptr(), _qlinear(head.plan, head.bias), layers)
        self._keep = (layers, parts, k_cache, v_cache, key_rounding, states)
        self._workspace = torch.empty(0, dtype=torch.uint8)

    def forward(self, ids: torch.Tensor, cos_sin: list[tuple[torch.Tensor, torch.Tensor]],
                slots: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor,
                logits_rows: torch.Tensor | None, serial: bool, lora=None,
                recent: Recent | None = None, images: ImageRows | None = None,
                delta: DeltaStep | None = None) -> torch.Tensor:
        """`lora`: the step's lora.LoraStep, when a row runs with an adapter; `recent`: an int8
        cache's recent rows, its twins every layer's ([layers, twins, ...]); `images`: the rows
        that are images' (their embeddings, and what each row sees past itself); `delta`: a
        hybrid's items' state slots and rows (its DeltaStates opened for this step)."""
        n = ids.numel()
        need = self.kernels.lib.decoder_workspace_bytes(ctypes.byref(self.c), n)
        if self._workspace.numel() < need:  # grown, never shrunk: one forward runs at a time
            self._workspace = torch.empty(need, dtype=torch.uint8)
        rows = n if logits_rows is None else logits_rows.numel()
        logits = torch.empty(rows * self.c.lm_head.out_cols)
        cos = (_PTR * len(cos_sin))(*(c.data_ptr() for c, _ in cos_sin))
        sin = (_PTR * len(cos_sin))(*(s.data_ptr() for _, s in cos_sin))
        threads = torch.get_num_threads()
        step = DStepC(n, ids.data_ptr(), cos, sin, slots.data_ptr(), tables.data_ptr(),
                      row_seq.data_ptr(), row_len.data_ptr(), tables.shape[1], rows, _ptr(logits_rows),
                      self._workspace.data_ptr(), logits.data_ptr(), threads, 1 if serial else threads,
                      *((lora.row_index.data_ptr(), ctypes.addressof(lora.tables)) if lora else (None, None)))
        if recent is not None:
            step.recent_k, step.recent_v = recent.rows_k.data_ptr(), recent.rows_v.data_ptr()
            step.twin_k, step.twin_v = recent.twins_k.data_ptr(), recent.twins_v.data_ptr()
            step.twin_layer = recent.twins_k[0].numel()
            step.twin_slots, step.first_row = recent.twin_slots.data_ptr(), recent.first_row.data_ptr()
            step.twin = recent.twin.data_ptr()
        if images is not None:
            step.embed_count, step.embed_rows = images.rows.numel(), images.rows.data_ptr()
            step.embed_values, step.row_ahead = images.values.data_ptr(), _ptr(images.ahead)
        if delta is not None:
            step.state_items, step.state_slots = len(delta.slots), delta.slots.data_ptr()
            step.state_start, step.state_count = delta.row_start.data_ptr(), delta.row_count.data_ptr()
        if self.kernels.lib.decoder_forward(ctypes.byref(self.c), ctypes.byref(step)) != 0:
            raise MemoryError("decoder forward: out of memory for the attention scores")
        return logits[: rows * self.vocab].view(rows, self.vocab)
