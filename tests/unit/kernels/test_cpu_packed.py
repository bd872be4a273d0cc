"""Linear weights pre-packed for oneDNN and viewed in place in a read-only mapping (kernels/cpu_packed.py)."""

from __future__ import annotations

import dataclasses
import mmap
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from keepwarm import kernels
from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta
from keepwarm.kernels import cpu_packed, cpu_step, dispatch
from keepwarm.kernels.cpu_packed import PackedWeight, pack, packed_layout, packed_nbytes, packing_available

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(
    not cpu_packed._probe(BF16),
    reason="bfloat16 weight packing unavailable here (needs mkldnn bf16 support and libtorch's AOTI C shim)")


@pytest.fixture(autouse=True)
def _packing_on(monkeypatch) -> None:
    monkeypatch.setenv(cpu_packed.ENV_VAR, "1")  # tests turn it off themselves; an outer =0 must not leak in


def _shm_dir(tmp_path: Path) -> Path:
    # tmpfs, like the daemon's arenas; the test's own dir where /dev/shm is missing.
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tmp_path


@pytest.fixture
def readonly_packed(tmp_path: Path):
    """Pack a weight, write its bytes to a tmpfs file at an offset, map it PROT_READ: (w, PackedWeight, mapping)."""
    made: list[tuple[Path, mmap.mmap]] = []

    def make(n: int, k: int, offset: int = 512) -> tuple[torch.Tensor, PackedWeight, mmap.mmap]:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 1000 + k)).to(BF16)
        raw, desc = pack(w)
        path = _shm_dir(tmp_path) / f"kw-test-packed-{os.getpid()}-{len(made)}.bin"
        path.write_bytes(b"\0" * offset + raw.numpy().tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, offset + raw.numel(), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        made.append((path, mapping))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: PROT_READ enforces it
            flat = torch.frombuffer(mapping, dtype=torch.uint8)
        meta = QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (n, k), desc.hex())
        return w, PackedWeight(meta, flat[offset:], BF16), mapping

    yield make
    for path, _ in made:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 33, 100])
def test_packed_linear_matches_f_linear_exactly(readonly_packed, rows: int, bias: bool) -> None:
    w, pw, _ = readonly_packed(96, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(BF16)
    b = torch.randn(96, generator=torch.Generator().manual_seed(5)).to(BF16) if bias else None
    assert torch.equal(kernels.linear(x, pw, b), F.linear(x, w, b))
    assert torch.equal(pw.dequantize(BF16), w)


def test_packed_weight_views_the_mapping_without_copy(readonly_packed) -> None:
    import numpy as np

    _, pw, mapping = readonly_packed(160, 96)
    base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    addr = torch.ops.mkldnn.data_ptr(pw.tensor)
    assert base <= addr and addr + pw.nbytes <= base + len(mapping)
    assert addr == base + 512 and pw.shape == torch.Size((160, 96)) and pw.dtype == BF16


def test_packed_nbytes_is_the_real_size() -> None:
    for shape in [(960, 576), (576, 1536), (577, 333), (7, 5), (48, 32)]:
        raw, desc = pack(torch.randn(shape).to(BF16))
        assert packed_nbytes(shape, BF16) == raw.numel()
        assert packed_layout(shape, BF16)[1] == desc  # the descriptor depends on shape and dtype only


def test_the_batch_hint_packs_what_f_linear_computes_at_every_row_count() -> None:
    """On an AMX CPU a hint of 1 (what earlier versions packed with) picks a format whose 100-row results differ
    from F.linear's; the hint used now gives F.linear's bits from 1 to 100 rows, and on such a CPU the two hints'
    formats differ."""
    from keepwarm.formats.packed import BATCH_HINT, LEGACY_HINTS

    w = torch.randn(576, 576, generator=torch.Generator().manual_seed(3)).to(BF16)
    raw, desc = pack(w)
    assert BATCH_HINT == 32 and desc == pack(w, hint=BATCH_HINT)[1]
    pw = PackedWeight(QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (576, 576), desc.hex()), raw, BF16)
    for rows in (1, 8, 32, 100):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(BF16)
        assert torch.equal(kernels.linear(x, pw), F.linear(x, w)), rows
    old_raw, old_desc = pack(w, hint=LEGACY_HINTS[0])  # an old image's weight still computes (its own format)
    old = PackedWeight(QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (576, 576), old_desc.hex()), old_raw, BF16)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4)).to(BF16)
    assert torch.equal(kernels.linear(x, old), F.linear(x, w))


def test_descriptor_round_trips_through_quant_meta() -> None:
    _, desc = pack(torch.randn(64, 32).to(BF16))
    meta = QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (64, 32), desc.hex())
    assert QuantMeta.from_dict(meta.to_dict()) == meta
    assert bytes.fromhex(QuantMeta.from_dict(meta.to_dict()).descriptor or "") == desc
    plain = QuantMeta("int8", "int8_channel", None, (64, 32))
    assert "descriptor" not in plain.to_dict() and QuantMeta.from_dict(plain.to_dict()) == plain
    with pytest.raises(QuantizationError):
        QuantMeta.from_dict({**meta.to_dict(), "descriptor": None})
    with pytest.raises(QuantizationError):
        QuantMeta.from_dict({**meta.to_dict(), "scheme": "int8"})


def test_only_bfloat16_packs() -> None:
    assert packing_available(BF16)
    assert not packing_available(torch.float32) and not packing_available(torch.float16)


def _planned(model_dir: str, quantization: str = "none", dtype: torch.dtype = BF16) -> dict[str, list[str]]:
    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.weights.loader import plan_arena

    planned, _ = plan_arena(Checkpoint(model_dir), quantization, dtype, "cpu")
    out: dict[str, list[str]] = {}
    for p in planned:
        out.setdefault(p.name, []).extend(e.part for e in p.entries)
    return out


def test_plan_packs_linears_and_head_and_env_turns_it_off(tiny_model_factory, monkeypatch) -> None:
    tied = tiny_model_factory("llama3_tied")
    parts = _planned(tied)
    assert parts["model.layers.0.self_attn.qkv_proj.weight"] == ["packed"]
    assert parts["model.layers.1.mlp.down_proj.weight"] == ["packed"]
    assert parts["lm_head.weight"] == ["packed"]  # made from the tied embedding
    assert parts["model.embed_tokens.weight"] == [""]  # stays plain for the lookup
    assert parts["model.norm.weight"] == [""]
    assert "packed" not in sum(_planned(tied, "int8").values(), [])
    assert "packed" not in sum(_planned(tied, dtype=torch.float32).values(), [])
    monkeypatch.setenv(cpu_packed.ENV_VAR, "0")
    assert "packed" not in sum(_planned(tied).values(), []) and "lm_head.weight" not in _planned(tied)


def _build(model_dir: str) -> tuple[object, dict]:
    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.weights.loader import build_arena, plan_arena
    from keepwarm.worker.attach import model_tensors

    ckpt = Checkpoint(model_dir)
    progress: list[int] = []
    _, total = plan_arena(ckpt, "none", BF16, "cpu")
    flat = torch.empty(total, dtype=torch.uint8)
    manifest = build_arena(ckpt, "none", "bfloat16", flat, "cpu", progress=progress.append, threads=2)
    assert sum(progress) == ckpt.nbytes  # the derived head is not counted twice
    return manifest, model_tensors(manifest, flat)


def test_fingerprint_ignores_packing(tiny_model_factory, monkeypatch) -> None:
    tied = tiny_model_factory("llama3_tied")
    packed, tensors = _build(tied)
    assert isinstance(tensors["lm_head.weight"], PackedWeight)
    assert torch.equal(tensors["lm_head.weight"].dequantize(BF16), tensors["model.embed_tokens.weight"])
    monkeypatch.setenv(cpu_packed.ENV_VAR, "0")
    plain, tensors = _build(tied)
    assert "lm_head.weight" not in tensors and not plain.quant
    assert packed.fingerprint == plain.fingerprint and packed.arena_digest != plain.arena_digest


@pytest.fixture
def layout_cache(tmp_path: Path, monkeypatch):
    """Point packed_layout at a layouts file of the test's own (``open()``: a new process's view of it)."""
    from keepwarm.formats import packed as fp

    path = tmp_path / "layouts.json"

    def open_() -> object:
        fp.packed_layout.cache_clear()  # the in-memory memo of this process
        cache = fp._LayoutCache(path)
        monkeypatch.setattr(fp, "_layout_cache", lambda: cache)
        return cache

    yield path, open_
    fp.packed_layout.cache_clear()


def test_a_layout_found_once_is_read_from_disk_by_a_later_process(layout_cache, monkeypatch) -> None:
    from keepwarm.formats import packed as fp

    path, open_ = layout_cache
    open_()
    shape = (320, 192)
    found = fp.packed_layout(shape, BF16)
    assert found == (pack(torch.randn(shape).to(BF16))[0].numel(), pack(torch.randn(shape).to(BF16))[1])
    open_()  # a fresh daemon: it must not pack zeros to know the layout

    def no_pack(*a, **k):
        raise AssertionError("packed a zero weight again")

    monkeypatch.setattr(fp, "pack", no_pack)
    assert fp.packed_layout(shape, BF16) == found and packed_nbytes(shape, BF16) == found[0]
    with pytest.raises(AssertionError, match="again"):  # another hint is another layout: not in the file
        fp.packed_layout(shape, BF16, 2)


def test_an_unreadable_layouts_file_is_probed_again_and_rewritten(layout_cache, caplog) -> None:
    from keepwarm.formats import packed as fp

    path, open_ = layout_cache
    path.write_text("{not json")
    open_()
    assert fp.packed_layout((64, 32), BF16)[0] == pack(torch.randn(64, 32).to(BF16))[0].numel()
    assert "unreadable" in caplog.text and "64x32:bfloat16:32" in path.read_text()


def test_the_layouts_file_is_per_cpu_and_torch(monkeypatch) -> None:
    from keepwarm.formats import packed as fp

    here = fp.cpu_torch_key()
    assert fp.cpu_torch_key() == here
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN then packs for another instruction set
    assert fp.cpu_torch_key() != here
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert fp.cpu_torch_key() != here


def test_a_stale_layout_fails_the_preload_naming_the_weight(tiny_model_factory, layout_cache) -> None:
    """A layouts file that is wrong for this CPU cannot make a wrong arena: the real pack is checked against it."""
    import json

    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.weights.loader import build_arena, plan_arena

    path, open_ = layout_cache
    tied = tiny_model_factory("llama3_tied")
    open_()
    plan_arena(Checkpoint(tied), "none", BF16, "cpu")  # every shape's layout now in the file
    layouts = json.loads(path.read_text())
    config = Checkpoint(tied).config
    key = f"{config.vocab_size}x{config.hidden_size}:bfloat16:32"  # the head's, made from the tied embedding
    n, desc = layouts[key]
    layouts[key] = [n, desc[:-2] + f"{(int(desc[-2:], 16) + 1) % 256:02x}"]
    path.write_text(json.dumps(layouts))
    open_()
    ckpt = Checkpoint(tied)
    _, total = plan_arena(ckpt, "none", BF16, "cpu")
    with pytest.raises(RuntimeError, match=r"lm_head.weight: oneDNN packed it in another format than planned"):
        build_arena(ckpt, "none", "bfloat16", torch.empty(total, dtype=torch.uint8), "cpu", threads=2)


def test_tensors_are_read_in_file_order_and_a_derived_head_right_after_its_source(tiny_model_factory) -> None:
    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.weights.loader import file_order, plan_arena

    planned, _ = plan_arena(Checkpoint(tiny_model_factory("llama3_tied")), "none", BF16, "cpu")
    order = file_order(planned)
    assert sorted(order) == list(range(len(planned)))
    firsts = [(str(planned[i].source.parts[0].file), planned[i].source.parts[0].offset) for i in order]
    assert firsts == sorted(firsts)
    head = next(i for i, p in enumerate(planned) if p.derived)
    embed = next(i for i, p in enumerate(planned) if p.name == "model.embed_tokens.weight")
    assert order.index(head) == order.index(embed) + 1


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_an_arena_written_with_pwrite_is_the_mapped_one(tiny_model_factory, tmp_path, quantization: str) -> None:
    """The daemon writes packed and converted tensors into its tmpfs arena file with pwrite (no page faults);
    the bytes, digests and manifest are those of the writes through the mapping."""
    from keepwarm.formats.arena import CpuArenaFile
    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.weights.loader import build_arena, plan_arena

    ckpt = Checkpoint(tiny_model_factory("llama3_tied"))
    _, total = plan_arena(ckpt, quantization, BF16, "cpu")
    built = []
    for i, through_file in enumerate((False, True)):
        path = _shm_dir(tmp_path) / f"kw-test-pwrite-{os.getpid()}-{i}.arena"
        arena = CpuArenaFile.create(path, total)
        try:
            manifest = build_arena(ckpt, quantization, "bfloat16", arena.flat, "cpu", threads=2,
                                   arena_file=path if through_file else None)
            built.append((manifest, path.read_bytes()))
        finally:
            arena.close()
            path.unlink()
    (mapped, mapped_bytes), (written, written_bytes) = built
    assert dataclasses.replace(written, created_at=0) == dataclasses.replace(mapped, created_at=0)
    assert written.arena_digest == mapped.arena_digest and written_bytes == mapped_bytes
    assert any(b != 0 for b in written_bytes[written.tensors[-1].offset:])  # the file really holds the tensors


@pytest.mark.parametrize("model_name", ["llama", "llama3_tied", "qwen2"])
def test_llm_greedy_same_with_and_without_packing(tiny_model_factory, monkeypatch, model_name: str) -> None:
    from keepwarm import LLM, SamplingParams

    model = tiny_model_factory(model_name)
    prompts = ["The quick brown fox", "Hello", "a b c d e f g"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # Packed oneDNN against F.linear op by op: the native decode step would run keepwarm's bf16 kernel in F.linear's
    # place (tests/unit/kernels/test_cpu_step.py bounds that one), and so would a dense weight's 1-4 rows on
    # AVX512-BF16 (tests/unit/kernels/test_cpu_bf16_gemv.py bounds that one).
    monkeypatch.setenv(cpu_step.ENV_VAR, "0")
    monkeypatch.setitem(dispatch._BY_OP, "linear", tuple(r for r in dispatch._BY_OP["linear"]
                                                         if r.kernel != dispatch.BF16_AVX512))
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(cpu_packed.ENV_VAR, flag)
        llm = LLM(model=model, dtype="bfloat16", daemon=False, max_model_len=128)
        model_ = llm.llm_engine.loaded.model
        assert isinstance(model_.lm_head.weight, PackedWeight) == (flag == "1")
        assert isinstance(model_.model.layers[0].mlp.down_proj.weight, PackedWeight) == (flag == "1")
        outs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.close()
    assert all(len(t) == 12 for t in outs["1"]) and outs["1"] == outs["0"]
