"""Build the model on placeholders and attach its weights: from the daemon's arena, or from disk.

Both paths produce the same tensors: a disk load builds a private arena with the daemon's own code
(``weights.loader.build_arena``: fuse, convert, quantize), so a worker serves identical numbers either way.

Under tensor or pipeline parallelism (``tp`` given) a rank on a CPU daemon attaches its own shard arena (its
pipeline stage's weights, cut for its tensor-parallel rank: the daemon cuts every (stage, rank)'s shard with
``weights.sharding`` in one pass over the checkpoint) and binds views into it: no copy. A rank that loads from disk
(or from a CUDA daemon, which keeps one whole arena) loads the whole model, then binds its stage's weights (views)
and, under tensor parallelism, keeps only its part of each (``weights.sharding``: copies; a disk load's full arena is
dropped, unless a stage's views hold it). Either way it builds its decoder from the rank's local config.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keepwarm.daemon.client import DaemonClient, DaemonError, ensure_daemon
from keepwarm.formats.layout import Layout
from keepwarm.formats.model_config import ModelConfig, parse_model_config
from keepwarm.formats.paths import RuntimeDirError
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import build_arena, plan_arena, resolve_dtype
from keepwarm.weights.sharding import Shard, local_config, shard_weights, stage_of, stage_tensors, vocab_block
from keepwarm.worker.attach import Attachment, attach_weights, model_tensors
from keepwarm.worker.models.llama import LlamaForCausalLM
from keepwarm.worker.models.registry import build_model
from keepwarm.worker.parallel.group import ParallelGroup
from keepwarm.worker.parallel.pipeline import make_stage

log = logging.getLogger("keepwarm.worker")


@dataclass(frozen=True)
class Preload:
    """How the weights were read and packed: by the daemon (``origin`` "preload" or "image": its ``status``
    figures for the arena) or by this worker (``origin`` "disk": reading the checkpoint and building its private
    arena, binding excluded)."""

    origin: str
    seconds: float
    source_bytes: int  # bytes read: the checkpoint's tensors, or the arena image
    arena_bytes: int  # the arena's allocation


def _daemon_preload(runtime_dir: Path | None, fingerprint: str) -> Preload | None:
    """The daemon's figures for the arena ``fingerprint`` (its ``status``: one request, once, at attach time; the
    attach reply does not carry them); None when it read nothing for it (an adopted arena, a shard after the first
    of a split load) or it does not answer (the weights are attached all the same)."""
    try:
        with DaemonClient(runtime_dir, timeout=2.0) as client:
            models = client.status().get("models", [])
    except (DaemonError, RuntimeDirError) as e:
        log.info("no preload figures from the daemon: %s", getattr(e, "message", e))
        return None
    for m in models:
        if m.get("fingerprint") == fingerprint and m.get("source_bytes", 0) > 0:
            return Preload(str(m["origin"]), float(m["load_seconds"]), int(m["source_bytes"]), int(m["arena_bytes"]))
    return None


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    source: str  # "daemon" | "disk"
    seconds: float
    nbytes: int
    fingerprint: str | None = None
    attachment: Attachment | None = None
    fallback_reason: str | None = None  # why a daemon load fell back to disk
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step of a daemon attach (startup breakdown)
    preload: Preload | None = None  # how the weights were read and built (keepwarm:preload_* on /metrics)

    def close(self) -> None:
        if self.attachment is not None:
            self.attachment.close()


def _nbytes(w: object) -> int:
    return int(getattr(w, "nbytes", 0))


def bind_model(config: ModelConfig, tensors: dict, max_position: int, device: torch.device,
               tp: ParallelGroup | None = None, presharded: bool = False) -> tuple[LlamaForCausalLM, int]:
    """The family's model with ``tensors`` bound (one rank's part of them under ``tp``: cut here, or already cut
    when ``presharded``); returns it and the bytes its weights take."""
    if tp is None:
        model = build_model(config, max_position, device)
        model.load_weights(tensors)
        return model, sum(_nbytes(w) for w in tensors.values())
    stage = stage_of(config, tp.pp_size, tp.stage_index) if tp.pp_size > 1 else None
    if stage is not None and not presharded:  # a pipeline stage: its own layers' weights (views: no copy)
        tensors = stage_tensors(tensors, stage)
    if tp.tp_size == 1:
        model = build_model(config, max_position, device)
    else:
        shard = Shard(tp.tp_rank, tp.tp_size)
        if not presharded:
            tensors = shard_weights(tensors, config, shard)
        model = build_model(local_config(config, tp.tp_size), max_position, device)
        model.make_tensor_parallel(*vocab_block(config.vocab_size, shard), tp.all_reduce)
    if stage is not None:
        make_stage(model, stage)
    model.load_weights(tensors)
    return model, sum(_nbytes(w) for w in tensors.values())


def load_from_disk(ckpt: Checkpoint, dtype: str, quantization: str, device: torch.device, max_position: int,
                   fallback_reason: str | None = None, tp: ParallelGroup | None = None) -> LoadedModel:
    t0 = time.perf_counter()
    _, total = plan_arena(ckpt, quantization, resolve_dtype(ckpt, dtype), device.type)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    manifest = build_arena(ckpt, quantization, dtype, flat, str(device))
    preload = Preload("disk", time.perf_counter() - t0, ckpt.nbytes, total)
    model, nbytes = bind_model(ckpt.config, model_tensors(manifest, flat), max_position, device, tp)
    total = total if tp is None else nbytes
    seconds = time.perf_counter() - t0
    log.info("loaded %s from disk (%s): %.1f MB in %.2fs", ckpt.model_dir.name, quantization, total / 1e6, seconds)
    return LoadedModel(model, ckpt.config, "disk", seconds, total, manifest.fingerprint,
                       fallback_reason=fallback_reason, preload=preload)


def load_from_daemon(model_dir: str, dtype: str, quantization: str, device: torch.device, max_position: int,
                     runtime_dir: Path | None = None, fingerprint: str | None = None,
                     tp: ParallelGroup | None = None) -> LoadedModel:
    t0 = time.perf_counter()
    # A parallel rank on CPU attaches its (stage, rank)'s shard arena; on CUDA the daemon keeps one arena, cut here.
    layout = Layout(tp.tp_rank, tp.tp_size, tp.stage_index, tp.pp_size) if tp is not None else Layout()
    sharded = not layout.whole and device.type == "cpu"
    att = attach_weights(model_dir, quantization, dtype, fingerprint, runtime_dir,
                         layout=layout if sharded else None)
    t1 = time.perf_counter()
    m = att.manifest
    if (m.device == "cpu") != (device.type == "cpu"):
        att.close()
        raise DaemonError("device_mismatch", f"the daemon keeps {m.model_name} on {m.device}, but this engine "
                                             f"runs on {device}")
    config = parse_model_config(m.config_json, m.generation_config_json, source=f"{m.model}/config.json")
    t2 = time.perf_counter()
    if tp is not None:  # this rank's shard arena (views), or its slices cut from the whole arena (copies)
        if sharded and m.layout != layout:
            att.close()
            raise DaemonError("bad_reply", f"asked for the shard of {layout}, the daemon answered with {m.layout}'s")
        model, nbytes = bind_model(config, att.tensors, max_position, device, tp, presharded=sharded)
        t4 = time.perf_counter()
        return LoadedModel(model, config, "daemon", t4 - t0, nbytes, m.model_fingerprint, att,
                           phases={"attach": att.seconds, "shard_and_bind" if not sharded else "bind": t4 - t2},
                           preload=_daemon_preload(runtime_dir, m.fingerprint))
    model = build_model(config, max_position, device)
    t3 = time.perf_counter()
    model.load_weights(att.tensors)
    t4 = time.perf_counter()
    # attach: the daemon's answer and the views into its arena; lease_keeper: starting its process
    phases = {"attach": att.seconds, "lease_keeper": t1 - t0 - att.seconds, "model_build": t3 - t2,
              "load_weights": t4 - t3}
    return LoadedModel(model, config, "daemon", t4 - t0, m.total_bytes, m.fingerprint, att, phases=phases,
                       preload=_daemon_preload(runtime_dir, m.fingerprint))


def load_model(model_dir: Path, dtype: str, quantization: str, device: torch.device, max_position: int,
               daemon: bool | str = "auto", runtime_dir: Path | None = None,
               fingerprint: str | None = None, tp: ParallelGroup | None = None) -> LoadedModel:
    """``daemon``: True = attach (start a daemon if none runs; fail if that fails), "start" = the same but fall
    back to disk when no daemon can be reached or started, "auto" = attach if a daemon answers, else disk,
    False = load from disk. A fallback to disk is logged and recorded in ``fallback_reason``."""
    if daemon is False or daemon == "off":
        return load_from_disk(Checkpoint(model_dir), dtype, quantization, device, max_position, tp=tp)
    daemon_device = "cuda" if device.type == "cuda" else "cpu"
    try:
        if daemon is True or daemon in ("on", "start"):
            client, started = ensure_daemon(runtime_dir, device=daemon_device)
            client.close()
            if started:  # the socket the client used: KEEPWARM_RUNTIME_DIR's when no dir was given
                log.info("started a keepwarm daemon for %s", client.socket_path.parent)
        else:
            probe = DaemonClient(runtime_dir)
            answered = probe.ping(timeout=1.0)
            probe.close()
            if answered is None:
                raise DaemonError("unavailable", f"no keepwarm daemon answers at {probe.socket_path}")
        return load_from_daemon(str(model_dir), dtype, quantization, device, max_position, runtime_dir, fingerprint,
                                tp)
    except (DaemonError, RuntimeDirError) as e:
        # A fingerprint asked for is exactly those weights: the checkpoint on disk does not have it; a model
        # resident in another tensor-parallel layout than asked for cannot be read from disk either.
        if daemon is True or daemon == "on" or getattr(e, "code", None) in ("fingerprint_mismatch", "tensor_parallel"):
            raise
        reason = getattr(e, "message", str(e))
    log.warning("weights from disk, not the daemon: %s", reason)
    loaded = load_from_disk(Checkpoint(model_dir), dtype, quantization, device, max_position, fallback_reason=reason,
                            tp=tp)
    if fingerprint is not None and loaded.fingerprint != fingerprint:
        found = (loaded.fingerprint or "?")[:16]
        raise DaemonError("fingerprint_mismatch", f"{model_dir.name} on disk has fingerprint {found}, not "
                                                  f"{fingerprint[:16]} ({reason})")
    return loaded
