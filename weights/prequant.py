"""Pre-quantized checkpoints: what `config.json`'s `quantization_config` says, and whether keepwarm runs it exactly.

Rules (the formats, ``SourceQuant.kind``, and each one's tensors: docs/quantization.md, "Checkpoint tensors"):
- A checkpoint's `quantization_config` decides how its linear weights are read. Every field that changes the
  numbers is checked; one keepwarm cannot run exactly is refused with one line naming the field and its value
  (`quantization_config.config_groups.group_0.weights.num_bits = 2 is not supported ...`). Unknown methods and
  fields that would change the weights (sparsity, transforms, a quantized KV cache) are refused, never ignored.
- The requested `--quantization` is resolved against the checkpoint (vLLM's behaviour): `auto` takes the
  checkpoint's own scheme; naming the same scheme (its method name or the keepwarm scheme it is served as) is
  allowed; anything else is an error, and `none` on a quantized checkpoint never dequantizes it silently.
- Activation quantization that is dynamic (computed per token at run time) is run weight-only: x stays in the
  activation dtype. That is logged once per checkpoint. Static activation scales are refused: the numbers would
  differ from the checkpoint's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.quant import INT4_GROUP_SIZES, SCHEMES, validate_scheme

log = logging.getLogger("keepwarm.daemon")

METHODS = ("compressed-tensors", "fp8", "gptq", "awq", "gguf")
AUTO = "auto"
_QC = "quantization_config"
# The linear layers keepwarm quantizes (weights/checkpoint.py fuses them); everything else stays dense.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SourceQuant:
    """How a pre-quantized checkpoint stores its projections' weights (see the module docstring)."""

    method: str  # quantization_config.quant_method (or "gguf")
    kind: str  # ct_pack | ct_int | ct_float | fp8 | gptq | awq | gguf
    scheme: str  # the keepwarm scheme it is served as: int4 | int8 | fp8
    bits: int
    symmetric: bool
    strategy: str  # tensor | channel | group | block
    group_size: int | None = None  # group strategy: columns per group
    block: tuple[int, int] | None = None  # block strategy: (rows, columns)
    g_idx: bool = False  # a per-column group index tensor is read (actorder group, GPTQ desc_act)
    zero_offset: int = 0  # GPTQ v1 stores zero points minus one
    activation_note: str | None = None  # dynamic activation quantization run weight-only (logged)

    @property
    def description(self) -> str:
        if self.kind == "gguf":
            return "GGUF (per-tensor types)"
        detail = f"{self.strategy}" + (f" {self.group_size}" if self.group_size else "") + \
            (f" {self.block[0]}x{self.block[1]}" if self.block else "")
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.method} {self.scheme} ({self.bits}-bit, {sym}, {detail}{', g_idx' if self.g_idx else ''})"

    def tensor_suffixes(self) -> tuple[tuple[str, bool], ...]:
        """(suffix, required) of each tensor a projection has in the checkpoint, in reading order."""
        if self.kind == "ct_pack":
            return (("weight_packed", True), ("weight_scale", True), ("weight_zero_point", not self.symmetric),
                    ("weight_g_idx", self.g_idx), ("weight_shape", False))
        if self.kind == "ct_int":
            return (("weight", True), ("weight_scale", True), ("weight_zero_point", not self.symmetric))
        if self.kind == "ct_float":
            return (("weight", True), ("weight_scale", True))
        if self.kind == "fp8":
            return (("weight", True), ("weight_scale_inv" if self.block else "weight_scale", True))
        if self.kind == "gptq":
            return (("qweight", True), ("qzeros", True), ("scales", True), ("g_idx", self.g_idx))
        if self.kind == "awq":
            return (("qweight", True), ("qzeros", True), ("scales", True))
        raise QuantizationError(f"no tensor naming for format {self.kind!r}")


def _field(path: str, value: Any, why: str = "is not supported") -> QuantizationError:
    return QuantizationError(f"{_QC}.{path} = {json.dumps(value)} {why}")


def _get(d: dict, key: str, path: str, default: Any = None) -> Any:
    if not isinstance(d, dict):
        raise _field(path, d, "must be a JSON object")
    return d.get(key, default)


def detect(config: dict[str, Any]) -> SourceQuant | None:
    """The checkpoint's quantization from its parsed config.json; None for a plain checkpoint. Raises
    QuantizationError (one line, naming the field and value) for anything keepwarm cannot run exactly."""
    qc = config.get(_QC)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"{_QC} = {json.dumps(qc)} must be a JSON object")
    method = qc.get("quant_method")
    parsers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "gptq": _gptq, "awq": _awq}
    if method not in parsers:
        raise _field("quant_method", method, f"is not supported (supported: {', '.join(parsers)})")
    return parsers[method](qc)


# ---------------------------------------------------------------------------------------------- compressed-tensors
# format -> weight type -> kind ("naive-quantized" holds either type as is, one value per element).
_CT_FORMATS = {"pack-quantized": {"int": "ct_pack"}, "naive-quantized": {"int": "ct_int", "float": "ct_float"},
               "int-quantized": {"int": "ct_int"}, "float-quantized": {"float": "ct_float"}}


def _compressed_tensors(qc: dict) -> SourceQuant:
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _field(key, qc[key], "is not supported (only dense quantized weights are)")
    if qc.get("kv_cache_scheme"):
        raise _field("kv_cache_scheme", qc["kv_cache_scheme"], "is not supported (use --kv-cache-dtype)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _field("quantization_status", status, "is not supported (only 'compressed' checkpoints are)")
    groups = _get(qc, "config_groups", "config_groups") or {}
    if len(groups) != 1:
        raise _field("config_groups", sorted(groups), "is not supported (exactly one group is)")
    (gname, group), = groups.items()
    gp = f"config_groups.{gname}"
    targets = _get(group, "targets", gp)
    if targets != ["Linear"]:
        raise _field(f"{gp}.targets", targets, "is not supported (only [\"Linear\"] is)")
    ignore = qc.get("ignore") or []
    stray = [p for p in ignore if any(proj in str(p) for proj in PROJECTIONS) or str(p).startswith("re:")]
    if stray:
        raise _field("ignore", ignore, "is not supported (projections must all be quantized)")
    if group.get("output_activations"):
        raise _field(f"{gp}.output_activations", group["output_activations"])
    fmt = group.get("format") or qc.get("format")
    if fmt not in _CT_FORMATS:
        raise _field(f"{gp}.format" if group.get("format") else "format", fmt,
                     f"is not supported (supported: {', '.join(_CT_FORMATS)})")
    w = _get(group, "weights", gp)
    wp = f"{gp}.weights"
    if not isinstance(w, dict):
        raise _field(wp, w, "must be a JSON object")
    wtype, bits, sym = w.get("type"), w.get("num_bits"), w.get("symmetric", True)
    kind = _CT_FORMATS[fmt].get(str(wtype))
    if kind is None:
        raise _field(f"{wp}.type", wtype, f"is not supported with {fmt} (supported: {', '.join(_CT_FORMATS[fmt])})")
    if w.get("dynamic"):
        raise _field(f"{wp}.dynamic", w["dynamic"])
    if kind == "ct_float":
        if bits != 8:
            raise _field(f"{wp}.num_bits", bits, "is not supported (float-quantized: 8, fp8 e4m3)")
        if not sym:
            raise _field(f"{wp}.symmetric", sym, "is not supported for fp8 weights")
    else:
        allowed = (4, 8) if kind == "ct_pack" else (8,)
        if bits not in allowed:
            raise _field(f"{wp}.num_bits", bits, f"is not supported (supported with {fmt}: "
                                                 f"{', '.join(map(str, allowed))})")
    strategy = w.get("strategy")
    group_size = block = None
    if strategy == "group":
        group_size = w.get("group_size")
        if kind == "ct_float" or group_size not in INT4_GROUP_SIZES:
            raise _field(f"{wp}.group_size", group_size,
                         f"is not supported (groups of {', '.join(map(str, INT4_GROUP_SIZES))} are)")
    elif strategy == "block":
        bs = w.get("block_structure")
        if kind != "ct_float" or not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(v, int) and v > 0
                                                                                 for v in bs)):
            raise _field(f"{wp}.block_structure", bs, f"is not supported for {fmt}")
        block = (bs[0], bs[1])
    elif strategy not in ("channel", "tensor") or (strategy == "tensor" and kind != "ct_float"):
        raise _field(f"{wp}.strategy", strategy, f"is not supported with {fmt}")
    # "weight" (alias "static") only changed GPTQ's rounding order; "group" (alias "dynamic", written by older
    # compressed-tensors) stores a per-column group index, weight_g_idx.
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", "static", "dynamic", False):
        raise _field(f"{wp}.actorder", actorder)
    g_idx = actorder in ("group", "dynamic") and strategy == "group"
    note = _ct_activations(group.get("input_activations"), f"{gp}.input_activations")
    scheme = "fp8" if kind == "ct_float" else f"int{bits}"
    assert isinstance(bits, int)  # checked above against the allowed widths
    return SourceQuant("compressed-tensors", kind, scheme, bits, bool(sym), str(strategy), group_size, block,
                       g_idx, activation_note=note)


def _ct_activations(a: Any, path: str) -> str | None:
    if not a:
        return None
    if not isinstance(a, dict):
        raise _field(path, a, "must be a JSON object")
    if not a.get("dynamic"):
        raise _field(f"{path}.dynamic", a.get("dynamic"), "is not supported (static activation scales: keepwarm "
                                                          "runs weights-only and would not match the checkpoint)")
    if a.get("dynamic") == "local":
        raise _field(f"{path}.dynamic", "local")
    return (f"{a.get('type', '?')}{a.get('num_bits', '?')} dynamic per-{a.get('strategy', '?')} activation "
            f"quantization is run weight-only (activations stay in the model dtype)")


# ---------------------------------------------------------------------------------------------- fp8 / gptq / awq
def _not_converted(qc: dict) -> None:
    skip = qc.get("modules_to_not_convert") or []
    stray = [m for m in skip if any(proj in str(m) for proj in PROJECTIONS)]
    if stray:
        raise _field("modules_to_not_convert", skip, "is not supported (projections must all be quantized)")


def _fp8(qc: dict) -> SourceQuant:
    _not_converted(qc)
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _field("fmt", fmt, "is not supported (only e4m3 is)")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise _field("activation_scheme", act, "is not supported (static activation scales; only dynamic is)")
    bs = qc.get("weight_block_size")
    if bs is not None and not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(v, int) and v > 0
                                                                            for v in bs)):
        raise _field("weight_block_size", bs, "is not supported (two positive integers are)")
    note = "fp8 dynamic activation quantization is run weight-only (activations stay in the model dtype)"
    if bs is None:
        return SourceQuant("fp8", "fp8", "fp8", 8, True, "tensor", activation_note=note)
    return SourceQuant("fp8", "fp8", "fp8", 8, True, "block", block=(bs[0], bs[1]), activation_note=note)


def _gptq_awq_group(qc: dict, key: str) -> tuple[str, int | None]:
    gs = qc.get(key, -1)
    if gs == -1:
        return "channel", None
    if gs not in INT4_GROUP_SIZES:
        raise _field(key, gs, f"is not supported (-1 or {', '.join(map(str, INT4_GROUP_SIZES))} are)")
    return "group", gs


def _gptq(qc: dict) -> SourceQuant:
    _not_converted(qc)
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _field("bits", bits, "is not supported (4 and 8 are)")
    strategy, gs = _gptq_awq_group(qc, "group_size")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _field("checkpoint_format", fmt, "is not supported (gptq and gptq_v2 are)")
    if qc.get("dynamic"):
        raise _field("dynamic", qc["dynamic"], "is not supported (per-module overrides)")
    desc_act = bool(qc.get("desc_act", False))
    return SourceQuant("gptq", "gptq", f"int{bits}", bits, bool(qc.get("sym", True)), strategy, gs,
                       g_idx=desc_act, zero_offset=1 if fmt == "gptq" else 0)


def _awq(qc: dict) -> SourceQuant:
    _not_converted(qc)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _field("version", qc.get("version"), "is not supported (only GEMM packing is)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _field("bits", bits, "is not supported (AWQ: 4)")
    strategy, gs = _gptq_awq_group(qc, "group_size" if "group_size" in qc else "q_group_size")
    zero_point = qc.get("zero_point", True)
    return SourceQuant("awq", "awq", "int4", 4, not zero_point, strategy, gs)


# A GGUF file: its tensors' types say how each is stored (keepwarm.formats.gguf); "gguf" names it for
# --quantization and in the daemon's listing.
GGUF_SOURCE = SourceQuant("gguf", "gguf", "gguf", 0, False, "group")


# ---------------------------------------------------------------------------------------------- --quantization
def resolve_quantization(requested: str, source: SourceQuant | None, where: str = "the checkpoint") -> str:
    """The keepwarm scheme a checkpoint is served as, given the requested `--quantization` (see the rules)."""
    requested = (requested or AUTO).strip().lower()
    if source is None:
        if requested == AUTO:
            return "none"
        if requested in METHODS and requested not in SCHEMES:
            raise QuantizationError(f"--quantization {requested} needs a checkpoint quantized by {requested}; "
                                    f"{where} has no {_QC}")
        return validate_scheme(requested)
    if requested in (AUTO, source.method, source.scheme):
        return source.scheme
    if requested == "none":
        raise QuantizationError(f"{where} is pre-quantized ({source.description}); --quantization none would "
                                f"dequantize it, which keepwarm never does silently: omit --quantization or pass "
                                f"{source.scheme}")
    raise QuantizationError(f"--quantization {requested} conflicts with {where}'s {_QC}.quant_method = "
                            f"{source.method} ({source.description}); omit --quantization or pass {source.scheme}")
