"""Portable snapshots across machines of different kinds (issue 48), for the tests: a "foreign" machine (a daemon
and CLI under capped CPU ISAs, so its oneDNN packing and int4 nibble order are not this machine's), arenas built in
this process (this CPU's layouts, or a CUDA arena's built in host memory), snapshots rewritten into a CUDA
machine's or into the layout of before the two layers, a tiny GGUF checkpoint, and greedy tokens from a daemon.

Rules: a CUDA image here is made by keepwarm's own loader with the CUDA layouts (``build_arena(device_type=
"cuda")``), never by hand; a rewritten snapshot keeps every blob it names in the store; nothing here asserts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keepwarm.formats.arena import LAYOUT_VERSION, ArenaManifest
from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.archive import export, import_archive
from keepwarm.snapshot.store import Store
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import build_arena, plan_arena, resolve_dtype
from support.daemon import Side

# A machine of another kind: oneDNN capped below this CPU's AMX / AVX-512 BF16 (another packed format for bf16
# weights) and ATen at its default kernels (another int4 nibble order).
FOREIGN_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "default"}
FAKE_GPU = "cuda:GPU-5e1f0c1a-0000-4000-8000-00000000feed"
CUDA_PLATFORM = {"device": "cuda", "name": "cuda-sm90", "key": "c0da90" + "0" * 18, "capability": "9.0",
                 "layout_version": LAYOUT_VERSION, "torch": torch.__version__, "gpu": "NVIDIA H100 (simulated)"}
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41))]


class ForeignSide(Side):
    """A Side whose daemon and CLI commands run as a machine of another kind (FOREIGN_ENV)."""

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, **FOREIGN_ENV}


def server_toml(path: Path, model: str | Path, quantization: str, dtype: str) -> Path:
    path.write_text(f'model = "{model}"\nquantization = "{quantization}"\ndtype = "{dtype}"\nmax_model_len = 128\n')
    return path


# -- arenas built in this process --------------------------------------------------------------------------------------
def build(model: str | Path, quantization: str, dtype: str, device_type: str = "cpu",
          ) -> tuple[ArenaManifest, torch.Tensor]:
    """The arena a preload makes of ``model`` on this CPU (``device_type="cuda"``: a CUDA arena's layouts, in host
    memory, its manifest naming FAKE_GPU) and its bytes; every byte outside a tensor is zero."""
    ckpt = Checkpoint(model)
    _, total = plan_arena(ckpt, quantization, resolve_dtype(ckpt, dtype), device_type)
    flat = torch.zeros(total, dtype=torch.uint8)
    device = "cpu" if device_type == "cpu" else FAKE_GPU
    return build_arena(ckpt, quantization, dtype, flat, device, threads=2, device_type=device_type), flat


def machine_from_portable(pm: ArenaManifest, src: torch.Tensor) -> tuple[ArenaManifest, torch.Tensor]:
    """This CPU's arena built from the portable form ``pm`` (bytes ``src``), as the daemon builds it, and its
    bytes (zero outside the tensors)."""
    from keepwarm.weights.portable import from_portable, plan_machine

    steps = plan_machine(pm, torch.device("cpu"))
    dest = torch.zeros(max((e.offset + e.nbytes for s in steps for e in s.entries), default=0), dtype=torch.uint8)
    out = dest.numpy()

    def write(e: Any, view: memoryview) -> None:
        out[e.offset:e.offset + e.nbytes] = np.frombuffer(view, dtype=np.uint8)

    return from_portable(pm, src, steps, write, "cpu"), dest


def file_bytes(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


# -- daemons -----------------------------------------------------------------------------------------------------------
def resident(side: Side, fingerprint: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the daemon's status entry of ``fingerprint``, its arena manifest as the daemon wrote it)."""
    st = side.status()
    (entry,) = [m for m in st["models"] if m["fingerprint"] == fingerprint]
    return entry, json.loads((Path(st["arena_dir"]) / f"{fingerprint}.json").read_text())


def evict_all(side: Side) -> None:
    from keepwarm.daemon.client import DaemonClient

    with DaemonClient(side.rt) as c:
        for m in c.status()["models"]:
            c.evict(m["fingerprint"], force=True)


def greedy(side: Side, model: str | Path, quantization: str, dtype: str, fingerprint: str | None = None,
           ) -> list[list[int]]:
    """Greedy tokens of PROMPTS from the arena the daemon of ``side`` holds (attached by ``fingerprint`` from a
    restored model directory, or preloaded from the checkpoint ``model``)."""
    from keepwarm import LLM, SamplingParams

    extra = {} if fingerprint is None else {"fingerprint": fingerprint}
    llm = LLM(model=str(model), dtype=dtype, quantization=quantization, max_model_len=128, daemon=True,
              runtime_dir=str(side.rt), **extra)
    try:
        if llm.weights_source != "daemon":
            raise RuntimeError(f"{model}: the engine did not attach to the daemon ({llm.weights_source})")
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


# -- snapshots ---------------------------------------------------------------------------------------------------------
def carry(src: Store, dst: Store, name: str, tmp: Path) -> None:
    """Snapshot ``name`` moved from one machine's store to another's the way an operator does (export, import)."""
    archive = tmp / f"{name}-{os.getpid()}.tar"
    export(src, name, archive)
    import_archive(dst.ensure(), archive, force=True)
    archive.unlink()


def put_arena(store: Store, m: ArenaManifest, flat: torch.Tensor) -> dict[str, Any]:
    """``{image, image_manifest, arena_digest}`` of the arena ``m`` (bytes ``flat``) landed in ``store``."""
    return {"image": store.put_bytes(flat[:m.total_bytes].numpy().tobytes()).ref(),
            "image_manifest": store.put_bytes(m.to_json().encode()).ref(), "arena_digest": m.arena_digest}


def as_cuda_snapshot(store: Store, template: str, name: str, model: str | Path, quantization: str,
                     dtype: str) -> dict[str, Any]:
    """Snapshot ``template`` of ``model`` rewritten as a CUDA machine makes it: its one platform image a CUDA
    arena (built on this CPU with the CUDA layouts, device FAKE_GPU, platform CUDA_PLATFORM), its portable layer
    that same blob (a CUDA arena's layouts are all portable) with the portable manifest. Saved as ``name``."""
    from keepwarm.weights.portable import to_portable

    m, flat = build(model, quantization, dtype, "cuda")
    image = put_arena(store, m, flat)
    pm = to_portable(m, flat, None)
    snap = store.load(template)
    mod = snap["models"][0]
    if mod["fingerprint"] != m.fingerprint:
        raise ValueError(f"snapshot {template} is not of {model} ({quantization}/{dtype})")
    layouts = sorted({q["layout"] for q in m.quant.values()} | {"dense"})
    mod.update(device=FAKE_GPU, arena_bytes=m.total_bytes, layouts=layouts,
               portable={**image, "image_manifest": store.put_bytes(pm.to_json().encode()).ref()},
               platforms=[{"platform": dict(CUDA_PLATFORM), **image}])
    snap["name"] = name
    store.save(snap)
    return snap


def as_single_image(store: Store, name: str, new_name: str, key: str) -> dict[str, Any]:
    """Snapshot ``name`` rewritten as one made before the two layers: its model entry's one ``image`` /
    ``image_manifest`` / ``arena_digest`` those of its platform image for ``key``; no portable layer, no platforms."""
    snap = store.load(name)
    mod = snap["models"][0]
    (img,) = [p for p in mf.platform_images(mod) if p["platform"]["key"] == key]
    for k in ("portable", "platforms"):
        del mod[k]
    mod.update({k: img[k] for k in ("image", "image_manifest", "arena_digest")})
    snap["name"] = new_name
    store.save(snap)
    return snap



# -- a tiny GGUF checkpoint --------------------------------------------------------------------------------------------
# The tiny llama's shapes (support/models.py "llama"); attention in Q4_0 (torch's CPU int4 pack: machine-specific),
# the MLP in Q8_0 (int8 groups), token embeddings plain, the output tied to them.
_GGUF_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_0", "ffn_gate": "Q8_0",
               "ffn_up": "Q8_0", "ffn_down": "Q8_0"}
_HIDDEN, _INTER, _HEADS, _KV_HEADS, _VOCAB, _LAYERS = 128, 256, 4, 2, 512, 2


def _blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks for an [n, k] weight: random codes, a sane float16 scale first in each block."""
    from keepwarm.formats.gguf import QUANT_TYPES

    _, per_block, block_bytes, _ = QUANT_TYPES[type_name]
    raw = rng.integers(0, 256, size=(n, k // per_block, block_bytes), dtype=np.uint8)
    scale = rng.uniform(-0.02, 0.02, size=(n, k // per_block)).astype(np.float16)
    raw[..., 0:2] = scale.view(np.uint8).reshape(n, k // per_block, 2)
    return raw.reshape(n, -1)


def write_tiny_gguf(out_dir: Path, tokenizer_from: str | Path) -> Path:
    """A two-layer llama GGUF in ``out_dir`` beside the tokenizer files of ``tokenizer_from`` (same vocabulary);
    returns the .gguf file."""
    import gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(tokenizer_from).iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, out_dir / f.name)
    path = out_dir / "tiny.gguf"
    hd = _HIDDEN // _HEADS
    shapes = {"attn_q": (_HIDDEN, _HIDDEN), "attn_k": (_KV_HEADS * hd, _HIDDEN), "attn_v": (_KV_HEADS * hd, _HIDDEN),
              "attn_output": (_HIDDEN, _HIDDEN), "ffn_gate": (_INTER, _HIDDEN), "ffn_up": (_INTER, _HIDDEN),
              "ffn_down": (_HIDDEN, _INTER)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(_LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(_HIDDEN)
    w.add_feed_forward_length(_INTER)
    w.add_head_count(_HEADS)
    w.add_head_count_kv(_KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(_VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(48)
    w.add_tensor("token_embd.weight", rng.normal(0, 0.5, size=(_VOCAB, _HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(_HIDDEN, dtype=np.float32))
    for i in range(_LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, _HIDDEN).astype(np.float32))
        for proj, type_name in _GGUF_TYPES.items():
            w.add_tensor(f"blk.{i}.{proj}.weight", _blocks(type_name, *shapes[proj], rng),
                         raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
