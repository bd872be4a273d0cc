"""The portable form of an arena (weights/portable.py), no processes:

- machine -> portable -> the same machine is the identity: for bf16 (oneDNN-packed where this CPU packs; a tied and
  an untied model), int8, int4, fp8, float32 and a compressed-tensors int4 checkpoint, the arena rebuilt from the
  portable form has the original's arena_digest, tensors, quant and bytes; ``machine_specific`` names exactly the
  packed and torch-int4-packed weights, and an arena without them is its own portable form (no file written);
- the portable form is the CUDA layout: it equals, manifest and bytes, the CUDA arena keepwarm's loader builds (in
  host memory) from the same checkpoint, and this CPU's arena built from that CUDA arena is a preload's;
- another machine's int4 nibble order (torch's other CPU pack, packed here by hand) has the same portable form;
- the platform descriptor names what the layouts depend on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from support.int4_pack import pack_int4
from support.portable import build, file_bytes, machine_from_portable

from keepwarm.formats.arena import arena_digest_of, tensor_byte_view
from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, cpu_int4_layout, is_quantized_target, unpack_int4
from keepwarm.kernels.cpu_packed import packing_available
from keepwarm.weights.portable import (
    PORTABLE_DEVICE,
    machine_specific,
    needs_repack,
    platform_descriptor,
    to_portable,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "quantized"
CASES = {  # id -> (tiny model or tests/data/quantized checkpoint, quantization, dtype)
    "bf16_tied": ("llama3_tied", "none", "bfloat16"),
    "bf16_untied": ("llama", "none", "bfloat16"),
    "int8": ("llama", "int8", "bfloat16"),
    "int4": ("llama", "int4", "bfloat16"),
    "fp8": ("llama", "fp8", "bfloat16"),
    "float32": ("llama", "none", "float32"),
    "ct_w4a16": ("w4a16_asym_g32", "auto", "bfloat16"),
}
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _model(tiny_model_factory, name: str) -> str:
    return str(DATA / name) if (DATA / name).is_dir() else tiny_model_factory(name)


def _expected_specific(m, model: str, quantization: str) -> set[str]:
    """The weights this CPU stores in a machine-specific layout, from the rules (not from the layouts): with
    quantization none, the 2-D matmul weights and lm_head where this CPU packs the dtype; int4 (asked for, or the
    checkpoint's), the quantized projections where torch has a CPU int4 pack."""
    weights = {e.weight for e in m.tensors}
    if quantization == "none":
        if not packing_available(torch.bfloat16) or m.dtype != "bfloat16":
            return set()
        return {w for w in weights if (is_quantized_target(w) or w == HEAD)}
    if cpu_int4_layout() is None or (quantization != "int4" and "w4" not in Path(model).name):
        return set()
    return {w for w in m.quant if is_quantized_target(w)}


@pytest.mark.parametrize("case", list(CASES))
def test_machine_to_portable_to_machine_is_bit_identical(case, tiny_model_factory, tmp_path) -> None:
    name, quantization, dtype = CASES[case]
    model = _model(tiny_model_factory, name)
    m, flat = build(model, quantization, dtype)
    specific = machine_specific(m)
    assert set(specific) == _expected_specific(m, model, quantization)
    out = tmp_path / "portable"
    pm = to_portable(m, flat, out)
    assert pm.device == PORTABLE_DEVICE and pm.fingerprint == m.fingerprint
    assert not machine_specific(pm)
    assert not any(q.get("layout") == LAYOUT_MKLDNN_PACKED or q.get("layout", "").startswith("int4_cpu_")
                   for q in pm.quant.values())
    if specific:
        src = file_bytes(out)
        assert pm.arena_digest != m.arena_digest and needs_repack(pm, torch.device("cpu"))
    else:  # nothing machine-specific: the arena is its own portable form, byte for byte (one blob in a snapshot)
        assert not out.exists() and (pm.tensors, pm.quant, pm.arena_digest) == (m.tensors, m.quant, m.arena_digest)
        assert not needs_repack(pm, torch.device("cpu"))
        src = flat
    assert arena_digest_of(src, pm.tensors, 2, pm.arena_digest_scheme) == pm.arena_digest
    tied = json.loads(m.config_json).get("tie_word_embeddings", False)
    if HEAD in specific and tied:  # a packed copy of the embedding: left out, derived again
        assert HEAD not in {e.weight for e in pm.tensors}
    elif HEAD in {e.weight for e in m.tensors}:
        assert HEAD in {e.weight for e in pm.tensors}

    back, dest = machine_from_portable(pm, src)
    assert back.arena_digest == m.arena_digest
    assert back.tensors == m.tensors and back.quant == m.quant and back.total_bytes == m.total_bytes
    assert torch.equal(dest[:m.total_bytes], flat[:m.total_bytes])


@pytest.mark.parametrize("case", ["bf16_tied", "bf16_untied", "int4", "int8", "fp8", "ct_w4a16"])
def test_the_portable_form_is_the_cuda_layout(case, tiny_model_factory, tmp_path) -> None:
    """A CPU arena's portable form equals, manifest and bytes, the CUDA arena of the same checkpoint (built on this
    CPU with the CUDA layouts); this CPU's arena made from that CUDA arena is a preload's, byte for byte."""
    name, quantization, dtype = CASES[case]
    model = _model(tiny_model_factory, name)
    m, flat = build(model, quantization, dtype)
    cuda, cflat = build(model, quantization, dtype, "cuda")
    assert cuda.fingerprint == m.fingerprint and not machine_specific(cuda)
    pm = to_portable(m, flat, tmp_path / "portable")
    src = file_bytes(tmp_path / "portable") if machine_specific(m) else flat
    assert pm.tensors == cuda.tensors and pm.quant == cuda.quant and pm.arena_digest == cuda.arena_digest
    end = cuda.total_bytes
    assert torch.equal(src[:end], cflat[:end]) and not bool(src[end:].any())

    from_cuda = to_portable(cuda, cflat, None)  # a CUDA arena is its own portable form
    assert from_cuda.arena_digest == cuda.arena_digest and from_cuda.device == PORTABLE_DEVICE
    back, dest = machine_from_portable(from_cuda, cflat)
    assert back.arena_digest == m.arena_digest and back.tensors == m.tensors and back.quant == m.quant
    assert torch.equal(dest[:m.total_bytes], flat[:m.total_bytes])


def test_another_int4_nibble_order_has_the_same_portable_form(tiny_model_factory, tmp_path) -> None:
    """The int4 arena rewritten in torch's other CPU pack (pairs instead of halves, or the other way round; packed
    by tests/support/int4_pack.py, not by keepwarm): another machine's arena of the same numbers. Its portable form
    is this one's, and this CPU rebuilds its own arena from it."""
    here = cpu_int4_layout()
    assert here is not None, "this torch has no CPU int4 pack"
    other = "int4_cpu_pairs32" if here != "int4_cpu_pairs32" else "int4_cpu_halves64"
    m, flat = build(tiny_model_factory("llama"), "int4", "bfloat16")
    foreign_flat = flat.clone()
    quant = json.loads(json.dumps(m.quant))
    for e in m.tensors:
        if e.part == "qweight" and quant.get(e.weight, {}).get("layout") == here:
            shape = tuple(quant[e.weight]["shape"])
            codes = unpack_int4(tensor_byte_view(flat, e), here, shape)
            tensor_byte_view(foreign_flat, e).copy_(pack_int4(codes, other).reshape(-1))
            quant[e.weight]["layout"] = other
    changed = [w for w, q in quant.items() if q["layout"] == other]
    assert changed and not torch.equal(foreign_flat, flat)
    from dataclasses import replace

    from keepwarm.formats.arena import combine_digests, leaf_digest

    leaves = [leaf_digest(memoryview(tensor_byte_view(foreign_flat, e).numpy())) for e in m.tensors]
    foreign = replace(m, quant=quant, arena_digest=combine_digests("arena", leaves))
    assert machine_specific(foreign) == machine_specific(m)
    pm_here = to_portable(m, flat, tmp_path / "here")
    pm_foreign = to_portable(foreign, foreign_flat, tmp_path / "foreign")
    assert pm_foreign.arena_digest == pm_here.arena_digest and pm_foreign.quant == pm_here.quant
    assert (tmp_path / "foreign").read_bytes() == (tmp_path / "here").read_bytes()
    back, dest = machine_from_portable(pm_foreign, file_bytes(tmp_path / "foreign"))
    assert back.arena_digest == m.arena_digest and torch.equal(dest[:m.total_bytes], flat[:m.total_bytes])


def test_platform_descriptor_names_what_the_layouts_depend_on() -> None:
    d = platform_descriptor(torch.device("cpu"))
    assert d["device"] == "cpu" and re.fullmatch(r"[0-9a-f]{24}", d["key"]) and d["name"].startswith("cpu-")
    assert d["int4_layout"] == (cpu_int4_layout() or "int4_canonical")
    assert (d["pack_key"] == "none") == (not packing_available(torch.bfloat16))
    assert re.search(r"\d+\.\d+", d["onednn"]), d["onednn"]  # the version, where torch's build names oneDNN
    assert d["torch"] == torch.__version__
    assert platform_descriptor(torch.device("cpu")) == d  # the same machine, the same key
