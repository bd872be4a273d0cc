"""Model directories keepwarm cannot serve get a one-line error naming what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keepwarm.formats.model_config import ModelConfigError, load_model_config
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import build_arena, plan_arena
from keepwarm.worker.attach import model_tensors


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case, pattern", [
    ("missing_dir", "does not exist"),
    ("not_a_dir", "is not a directory"),
    ("no_config", "config.json is missing"),
    ("bad_json", "is not valid JSON"),
    ("unsupported_arch", "unsupported architecture 'GPT2LMHeadModel'"),
    ("no_weights", "has no \\*.safetensors weights"),
    ("pickle_only", "never loads pickle"),
    ("missing_key", "lacks required key 'hidden_size'"),
    ("missing_tensor", "lacks tensor 'model.norm.weight'"),
    ("truncated", "extends past the end of the file"),
    ("missing_shard", "shard\\(s\\) named in the index are missing"),
])
def test_bad_model_dirs(tiny_llama: str, tmp_path: Path, case: str, pattern: str) -> None:
    d = tmp_path / "m"
    if case == "missing_dir":
        pass
    elif case == "not_a_dir":
        d.write_text("x")
    else:
        _copy(tiny_llama, d)
        st = d / "model.safetensors"
        if case == "no_config":
            (d / "config.json").unlink()
        elif case == "bad_json":
            (d / "config.json").write_text("{not json")
        elif case == "unsupported_arch":
            _edit_config(d, architectures=["GPT2LMHeadModel"])
        elif case == "no_weights":
            st.unlink()
        elif case == "pickle_only":
            st.rename(d / "pytorch_model.bin")
        elif case == "missing_key":
            cfg = json.loads((d / "config.json").read_text())
            del cfg["hidden_size"]
            (d / "config.json").write_text(json.dumps(cfg))
        elif case == "missing_tensor":
            from safetensors.torch import load_file, save_file

            tensors = load_file(st)
            del tensors["model.norm.weight"]
            save_file(tensors, st)
        elif case == "truncated":
            data = st.read_bytes()
            st.write_bytes(data[: len(data) // 2])
        elif case == "missing_shard":
            (d / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelConfigError, match=pattern) as info:
        Checkpoint(d)
    assert "\n" not in str(info.value)


def test_cli_reports_bad_model_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "generate", "--model", str(tmp_path / "nope"),
                           "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"error: model directory {str(tmp_path / 'nope')!r} does not exist"
    assert "Traceback" not in proc.stderr


def _fused(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The fused tensors a disk load gives the model (float32: plain tensors, nothing packed)."""
    _, total = plan_arena(ckpt, "none", torch.float32)
    flat = torch.empty(total, dtype=torch.uint8)
    return model_tensors(build_arena(ckpt, "none", "float32", flat, "cpu"), flat)


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    from keepwarm.worker.models.random_model import make_random_model

    single = make_random_model(tmp_path / "single", "llama", head_dim=32, seed=5)
    sharded = make_random_model(tmp_path / "sharded", "llama", head_dim=32, seed=5, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = _fused(Checkpoint(single)), _fused(Checkpoint(sharded))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Fusion: qkv is q, k and v stacked along the output dimension.
    from safetensors.torch import load_file

    raw = load_file(single / "model.safetensors")
    p = "model.layers.0.self_attn."
    expected = torch.cat([raw[p + "q_proj.weight"], raw[p + "k_proj.weight"], raw[p + "v_proj.weight"]])
    assert torch.equal(a[p + "qkv_proj.weight"], expected)


def test_rope_parameters_read_from_both_layouts(tmp_path: Path, tiny_llama: str) -> None:
    d = _copy(tiny_llama, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 123.0
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 128}
    (d / "config.json").write_text(json.dumps(cfg))
    mc = load_model_config(d)
    assert mc.rope.theta == 123.0 and mc.rope.rope_type == "llama3" and mc.rope.factor == 4.0
    _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="unsupported rope_type 'yarn'"):
        load_model_config(d)
