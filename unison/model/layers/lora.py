"""LoRA adapters: PEFT's files read and checked against the base model, and a step's per-row
update, y = base(x) + scale * (x A) B for every targeted linear, with each row's own adapter.

The model fuses q|k|v into one linear and gate|up into another: an adapter's modules become parts
of those linears, each with its own A and B and its columns in the fused output. On CPU with the
C kernels the update is csrc/lora.c (batch invariant: a row's bits do not depend on the batch);
elsewhere torch runs it per adapter over that adapter's rows (S-LoRA's gather, two GEMMs, scatter).
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from unison.model.families import ModelConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEARS = ("qkv", "o_proj", "gate_up", "down")  # the model's linears per layer, in forward order
# Each target's (linear, part index): parts keep this order inside a fused linear's output.
PLACES = {"q_proj": (0, 0), "k_proj": (0, 1), "v_proj": (0, 2), "o_proj": (1, 0), "gate_proj": (2, 0),
          "up_proj": (2, 1), "down_proj": (3, 0)}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_REFUSED_NAMES = ("lm_head", "embed_tokens")  # the vocabulary's modules: not adapted here


@dataclass(slots=True)
class LoraPart:
    """One module's update inside its (maybe fused) linear: out[:, offset:offset + n] += (x a) b."""

    # Laid out for the C kernel (csrc/lora.h), whose pieces of work then read whole cache lines:
    a: Tensor  # [ceil(rank / 8), in, 8] float32: lora_A in panels of 8 ranks (zeros past the rank)
    b: Tensor  # [ceil(n / 16), rank, 16] float32: lora_B times the scale, in tiles of 16 columns
    rank: int
    n: int  # the part's columns, from `offset` on in the linear's output
    offset: int

    def plain(self) -> tuple[Tensor, Tensor]:
        """(A [in, rank], B [rank, n]) as plain matrices: x A B is the update (torch's path)."""
        a = self.a.transpose(0, 1).reshape(self.a.shape[1], -1)[:, : self.rank]
        return a, self.b.transpose(0, 1).reshape(self.rank, -1)[:, : self.n]


@dataclass(slots=True)
class LoraWeights:
    rank: int  # the largest module rank
    alpha: float  # lora_alpha
    scale: float  # alpha / rank (alpha / sqrt(rank) with use_rslora); a pattern may set a module's
    targets: tuple[str, ...]  # which of LORA_TARGETS it adapts, in that order
    nbytes: int  # of A and B as stored (float32, A's rank padded to a multiple of 8)
    # Per layer, per linear (LINEARS order), the parts it adapts, in output order ((): none).
    layers: list[tuple[tuple[LoraPart, ...], ...]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module of a layer, as the base model has them (attention only
    in a mixture of experts: adapters on the experts are not run). A gated attention's q_proj
    gives each head's query and gate: twice the width."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    q_out = 2 * q if cfg.family.attn_output_gate else q
    attention = {"q_proj": (h, q_out), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if cfg.moe is not None:
        return attention
    return attention | {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _refuse_experts(cfg: ModelConfig, name: str, where: str) -> None:
    if cfg.moe is not None and (name in ("gate_proj", "up_proj", "down_proj") or "experts" in name):
        raise ValueError(f"{where} {name!r} targets the MLP of a mixture of experts ({cfg.architecture}), "
                         "which LoRA does not adapt here: target the attention modules (q/k/v/o_proj)")


# ---- reading PEFT's files --------------------------------------------------------------------

def read_peft(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraWeights:
    """The adapter in directory `path` (adapter_config.json + adapter_model.safetensors, as PEFT's
    save_pretrained writes them) for a base model of `cfg`. What cannot run here as PEFT would
    run it is refused with ValueError naming the reason and the field or file."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r}: no such directory")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {name}")
    config = _read_config(path / ADAPTER_CONFIG)
    tensors = _read_tensors(path / ADAPTER_WEIGHTS)
    modules = _modules(tensors, cfg, path)
    _check_targets(config, {m for _, m in modules}, path, cfg)
    _check_layers(config, {layer for layer, _ in modules}, path)
    return _build(config, modules, tensors, cfg, max_rank, path)


def _read_config(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    where = f"{file}:"
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where} peft_type {config['peft_type']!r} is not LORA")
    if config.get("modules_to_save"):
        raise ValueError(f"{where} modules_to_save {config['modules_to_save']} (whole modules replaced) "
                         "is not supported: only LoRA's A and B")
    if config.get("use_dora"):
        raise ValueError(f"{where} use_dora is not supported (DoRA rescales the base weight)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"{where} bias={config.get('bias')!r}, lora_bias={config.get('lora_bias')!r}: "
                         "only bias='none' is supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{where} fan_in_fan_out is for Conv1D bases (GPT-2), not this model")
    for name in ("r", "lora_alpha"):
        if not isinstance(config.get(name), int | float) or config[name] <= 0:
            raise ValueError(f"{where} {name} must be a positive number, got {config.get(name)!r}")
    config["_file"] = file
    return config


def _read_tensors(file: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from e


def _modules(tensors: dict[str, Tensor], cfg: ModelConfig, path: Path) -> list[tuple[int, str]]:
    """(layer, target) of every module the file adapts, each with its A and B, checked to exist."""
    file, found = path / ADAPTER_WEIGHTS, set()
    for key, tensor in tensors.items():
        _refuse_experts(cfg, key if ".experts." in key else key.split(".")[-3], f"{file}:")
        refused = next((n for n in _REFUSED_NAMES if f".{n}." in key), None)
        if refused:
            raise ValueError(f"{file}: {key!r} adapts {refused}, which is not supported (only the "
                             f"layers' {', '.join(LORA_TARGETS)})")
        m = _KEY.fullmatch(key)
        if m is None or m[3] not in LORA_TARGETS:
            raise ValueError(f"{file}: {key!r} is not a LoRA weight of a module the base model "
                             f"({cfg.architecture}) has: {', '.join(LORA_TARGETS)}")
        layer = int(m[1])
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"{file}: {key!r} adapts layer {layer}; the base model has "
                             f"{cfg.num_hidden_layers} layers")
        if m[3] in _ATTENTION and cfg.layer_types[layer] != "full_attention":
            raise ValueError(f"{file}: {key!r} adapts {m[3]} of layer {layer}, a linear-attention layer "
                             f"of {cfg.architecture}, which has none")
        if not tensor.is_floating_point():
            raise ValueError(f"{file}: {key!r} is {str(tensor.dtype).removeprefix('torch.')}: "
                             "a floating-point tensor is needed")
        found.add((layer, m[3], m[4]))
    modules = sorted({(layer, name) for layer, name, _ in found})
    for layer, name in modules:
        for ab in "AB":
            if (layer, name, ab) not in found:
                raise ValueError(f"{file} has no lora_{ab} for layers.{layer}.{name} (its lora_"
                                 f"{'BA'[ab == 'B']} is there)")
    if not modules:
        raise ValueError(f"{file} holds no LoRA weights")
    return modules


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _check_layers(config: dict, layers: set[int], path: Path) -> None:
    chosen = config.get("layers_to_transform")
    if chosen is None or chosen == []:
        return
    chosen = {chosen} if isinstance(chosen, int) else set(chosen)
    if extra := layers - chosen:
        raise ValueError(f"{path / ADAPTER_WEIGHTS} adapts layers {sorted(extra)}, which "
                         f"layers_to_transform {config['layers_to_transform']} excludes")


def _check_targets(config: dict, adapted: set[str], path: Path, cfg: ModelConfig) -> None:
    where, targets = f"{config['_file']}:", config.get("target_modules")
    if isinstance(targets, str):  # a regex over module names, or PEFT's shorthand
        if targets != "all-linear":
            for name in _REFUSED_NAMES:
                if re.fullmatch(targets, f"model.{name}") or re.fullmatch(targets, name):
                    raise ValueError(f"{where} target_modules {targets!r} matches {name}, which is not "
                                     "supported")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where} target_modules must be a list of names or a regex string, got {targets!r}")
    for target in targets:
        name = target.rsplit(".", 1)[-1]
        _refuse_experts(cfg, name, f"{where} target_modules names")
        if name in _REFUSED_NAMES:
            raise ValueError(f"{where} target_modules names {target!r}, which is not supported (only the "
                             f"layers' {', '.join(LORA_TARGETS)})")
        if name not in LORA_TARGETS:
            raise ValueError(f"{where} target_modules names {target!r}, a module the base model does not "
                             f"have (it has {', '.join(LORA_TARGETS)})")
    if extra := adapted - {t.rsplit(".", 1)[-1] for t in targets}:
        raise ValueError(f"{path / ADAPTER_WEIGHTS} adapts {sorted(extra)}, which target_modules "
                         f"{targets} does not name")


def _pattern(patterns: dict, key: str, default: float) -> float:
    # PEFT's get_pattern_key: the first pattern that matches the module name's tail.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _build(config: dict, modules: list[tuple[int, str]], tensors: dict[str, Tensor], cfg: ModelConfig,
           max_rank: int, path: Path) -> LoraWeights:
    where, shapes, rslora = config["_file"], module_shapes(cfg), bool(config.get("use_rslora"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    # [layer][linear]: (index among the linear's parts, the part)
    layers: list[list[list[tuple[int, LoraPart]]]] = [[[] for _ in LINEARS]
                                                      for _ in range(cfg.num_hidden_layers)]
    nbytes, rank = 0, 0
    for layer, name in modules:
        group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        module = f"model.layers.{layer}.{group}.{name}"
        a, b = (tensors[f"base_model.model.{module}.lora_{ab}.weight"] for ab in "AB")
        r = int(_pattern(rank_pattern, module, config["r"]))
        _check_shapes(a, b, r, shapes[name], module, max_rank, path, where)
        alpha = float(_pattern(alpha_pattern, module, config["lora_alpha"]))
        scale = alpha / (math.sqrt(r) if rslora else r)
        # The scale is folded into B once: one float32 rounding per element of B, where PEFT rounds
        # the product once per output (equal to within an ulp of the update, itself a few percent of
        # the output; exact when the scale is a power of two, as alpha = 2 r makes it).
        linear, index = PLACES[name]
        offset = sum(shapes[t][1] for t, (li, i) in PLACES.items() if li == linear and i < index)
        part = LoraPart(_tiles(a.float(), 8), _tiles(b.float() * scale, 16), r, b.shape[0], offset)
        layers[layer][linear].append((index, part))
        nbytes += 4 * (part.a.numel() + part.b.numel())
        rank = max(rank, r)
    adapted = {name for _, name in modules}
    r, alpha = config["r"], float(config["lora_alpha"])
    return LoraWeights(
        rank=rank, alpha=alpha, scale=alpha / (math.sqrt(r) if rslora else r),
        targets=tuple(t for t in LORA_TARGETS if t in adapted), nbytes=nbytes,
        layers=[tuple(tuple(p for _, p in sorted(parts, key=lambda ip: ip[0])) for parts in layer)
                for layer in layers])


def _tiles(m: Tensor, size: int) -> Tensor:
    """m [rows, cols] as [ceil(rows / size), cols, size]: tile i holds rows size i .. size i +
    size - 1 (zeros past the last), column by column."""
    rows, cols = m.shape
    padded = torch.zeros(-(-rows // size) * size, cols)
    padded[:rows] = m
    return padded.view(-1, size, cols).transpose(1, 2).contiguous()


def _check_shapes(a: Tensor, b: Tensor, r: int, shape: tuple[int, int], module: str, max_rank: int,
                  path: Path, where: Path) -> None:
    file, (n_in, n_out) = path / ADAPTER_WEIGHTS, shape
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"{file}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                         "[r, in] and [out, r]")
    if a.shape[0] != r:
        raise ValueError(f"{file}: {module} has rank {a.shape[0]}; {where} says r={r}")
    if r > max_rank:
        raise ValueError(f"{where}: {module} has rank {r}, above the maximum LoRA rank {max_rank} "
                         "(max_lora_rank)")
    if a.shape[1] != n_in or b.shape[0] != n_out:
        raise ValueError(f"{file}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                         f"the base model's linear ({n_out} x {n_in}): expected [{r}, {n_in}] and "
                         f"[{n_out}, {r}]")


# ---- running them ----------------------------------------------------------------------------

class LoraPartC(ctypes.Structure):  # csrc/lora.h LoraPart
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("n", ctypes.c_int64), ("offset", ctypes.c_int64)]


class LoraLinearC(ctypes.Structure):  # csrc/lora.h LoraLinear
    _fields_ = [("parts", ctypes.c_int64), ("part", LoraPartC * 3)]


class Adapter:
    """A loaded adapter as the forward runs it: its weights on the model's device and, for the C
    kernels, its table of linears ([layers * 4] LoraLinear)."""

    def __init__(self, weights: LoraWeights, device: torch.device) -> None:
        self.weights = weights
        self.device = device
        self.linears = [parts for layer in weights.layers for parts in layer]  # [layer * 4 + linear]
        self.table = (LoraLinearC * len(self.linears))()
        for c, parts in zip(self.table, self.linears):
            c.parts = len(parts)
            for i, p in enumerate(parts):
                c.part[i] = LoraPartC(p.a.data_ptr(), p.b.data_ptr(), p.rank, p.n, p.offset)
        self._plain: list[tuple[tuple[Tensor, Tensor, int], ...]] | None = None

    def plain(self, linear: int) -> tuple[tuple[Tensor, Tensor, int], ...]:
        """(A, B, offset) of each part of linear `linear`, plain and on the device: torch's path."""
        def on_device(p: LoraPart) -> tuple[Tensor, Tensor, int]:
            a, b = p.plain()
            return a.to(self.device), b.to(self.device), p.offset

        if self._plain is None:
            self._plain = [tuple(on_device(p) for p in parts) for parts in self.linears]
        return self._plain[linear]


class LoraStep:
    """A step's rows and their adapters, for the forward's hook after each linear."""

    def __init__(self, row_adapters: list[int], adapters: dict[int, Adapter], kernels, device: torch.device):
        ids = list(dict.fromkeys(a for a in row_adapters if a))  # this step's adapters, in order
        unknown = [a for a in ids if a not in adapters]
        if unknown:
            raise ValueError(f"LoRA adapter ids {unknown} are not loaded")
        self.adapters, self.kernels = [adapters[a] for a in ids], kernels
        index = {a: i for i, a in enumerate(ids)}
        if kernels is not None:  # the C kernel: each row's index into this step's tables
            self.row_index = torch.tensor([index[a] if a else -1 for a in row_adapters], dtype=torch.int64)
            self.tables = (ctypes.c_void_p * len(ids))(*(ctypes.addressof(a.table) for a in self.adapters))
        else:  # torch: each adapter's rows
            rows = [[r for r, a in enumerate(row_adapters) if a == i] for i in ids]
            self.rows = [torch.tensor(r, dtype=torch.int64, device=device) for r in rows]

    def apply(self, linear: int, x: Tensor, y: Tensor) -> None:
        """y += the update of linear `linear` (layer * 4 + LINEARS index) for x, row by row."""
        if self.kernels is not None:
            self.kernels.lora_apply(x, y, self.row_index, self.tables, linear)
            return
        for adapter, rows in zip(self.adapters, self.rows):
            parts = adapter.plain(linear)
            if not parts:
                continue
            xs = x.index_select(0, rows).float()
            for a, b, offset in parts:
                y[:, offset: offset + b.shape[1]].index_add_(0, rows, ((xs @ a) @ b).to(y.dtype))
