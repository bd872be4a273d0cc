"""Pre-quantized checkpoints: detection, refusal with one line naming the field, `--quantization` resolution."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.daemon import DaemonProc, new_runtime_dir, remove_runtime_dir

from keepwarm.formats.errors import QuantizationError
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.prequant import detect, resolve_quantization

# llm-compressor's W4A16 (data-free) config as it writes it, and its FP8_DYNAMIC one.
W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None, "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                    "dynamic": False, "actorder": None, "block_structure": None}}},
}
FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True}}},
}
_W = ("config_groups", "group_0", "weights")


def _with(base: dict, path: tuple[str, ...], value) -> dict:
    cfg = copy.deepcopy(base)
    d = cfg
    for key in path[:-1]:
        d = d[key]
    d[path[-1]] = value
    return {"quantization_config": cfg}


@pytest.mark.parametrize("base, path, value, message", [
    (W4A16, (*_W, "num_bits"), 2, "quantization_config.config_groups.group_0.weights.num_bits = 2 is not supported"),
    (W4A16, (*_W, "type"), "float", "quantization_config.config_groups.group_0.weights.type = \"float\""),
    (W4A16, (*_W, "group_size"), 16, "quantization_config.config_groups.group_0.weights.group_size = 16"),
    (W4A16, (*_W, "strategy"), "tensor_group", "weights.strategy = \"tensor_group\" is not supported"),
    (W4A16, (*_W, "actorder"), "sorted", "weights.actorder = \"sorted\""),
    (W4A16, (*_W, "dynamic"), True, "weights.dynamic = true"),
    (W4A16, ("config_groups", "group_0", "format"), "nvfp4-pack-quantized",
     "quantization_config.config_groups.group_0.format = \"nvfp4-pack-quantized\" is not supported"),
    (W4A16, ("sparsity_config",), {"format": "sparse-24-bitmask"}, "quantization_config.sparsity_config = {"),
    (W4A16, ("transform_config",), {"config_groups": {}}, "quantization_config.transform_config"),
    (W4A16, ("kv_cache_scheme",), {"num_bits": 8}, "quantization_config.kv_cache_scheme"),
    (W4A16, ("quantization_status",), "frozen", "quantization_config.quantization_status = \"frozen\""),
    (W4A16, ("ignore",), ["lm_head", "re:.*down_proj"],
     "quantization_config.ignore = [\"lm_head\", \"re:.*down_proj\"]"),
    (W4A16, ("config_groups", "group_0", "targets"), ["re:.*q_proj"], "group_0.targets = [\"re:.*q_proj\"]"),
    (W4A16, ("quant_method",), "bitsandbytes",
     "quantization_config.quant_method = \"bitsandbytes\" is not supported"),
    (FP8_DYNAMIC, ("config_groups", "group_0", "input_activations", "dynamic"), False,
     "quantization_config.config_groups.group_0.input_activations.dynamic = false is not supported"),
    (FP8_DYNAMIC, (*_W, "num_bits"), 4, "weights.num_bits = 4 is not supported (float-quantized: 8"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, ("activation_scheme",), "static",
     "quantization_config.activation_scheme = \"static\""),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, ("weight_block_size",), [128],
     "quantization_config.weight_block_size = [128]"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, ("bits",), 3, "quantization_config.bits = 3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, ("checkpoint_format",), "marlin",
     "quantization_config.checkpoint_format = \"marlin\""),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, ("version",), "gemv",
     "quantization_config.version = \"gemv\" is not supported (only GEMM packing is)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, ("modules_to_not_convert",), ["mlp.down_proj"],
     "quantization_config.modules_to_not_convert"),
])
def test_unsupported_fields_are_refused_naming_field_and_value(base, path, value, message) -> None:
    with pytest.raises(QuantizationError) as e:
        detect(_with(base, path, value))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_supported_configs_are_described() -> None:
    assert detect({}) is None
    w4 = detect({"quantization_config": W4A16})
    assert (w4.kind, w4.scheme, w4.group_size, w4.symmetric, w4.g_idx) == ("ct_pack", "int4", 128, True, False)
    fp8 = detect({"quantization_config": FP8_DYNAMIC})
    assert (fp8.kind, fp8.scheme, fp8.strategy) == ("ct_float", "fp8", "channel")
    assert "run weight-only" in fp8.activation_note
    actorder = detect(_with(W4A16, (*_W, "actorder"), "group"))
    assert actorder.g_idx
    gptq = detect({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True,
                                           "sym": False}})
    assert (gptq.scheme, gptq.strategy, gptq.g_idx, gptq.zero_offset, gptq.symmetric) == ("int8", "channel", True, 1,
                                                                                          False)
    block = detect({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert (block.scheme, block.block, block.tensor_suffixes()[1][0]) == ("fp8", (128, 128), "weight_scale_inv")


@pytest.mark.parametrize("requested, source, expected", [
    ("auto", None, "none"), ("none", None, "none"), ("int8", None, "int8"), ("auto", W4A16, "int4"),
    ("int4", W4A16, "int4"), ("compressed-tensors", W4A16, "int4"), ("fp8", FP8_DYNAMIC, "fp8"),
    ("none", W4A16, "--quantization none would dequantize it, which keepwarm never does silently"),
    ("int8", W4A16, "--quantization int8 conflicts with m's quantization_config.quant_method = compressed-tensors"),
    ("fp8", W4A16, "--quantization fp8 conflicts"),
    ("gptq", None, "--quantization gptq needs a checkpoint quantized by gptq; m has no quantization_config"),
    ("int3", None, "unknown quantization 'int3'"),
])
def test_quantization_flag_resolution(requested, source, expected) -> None:
    src = None if source is None else detect({"quantization_config": source})
    if expected in ("none", "int8", "int4", "fp8"):
        assert resolve_quantization(requested, src, "m") == expected
    else:
        with pytest.raises(QuantizationError) as e:
            resolve_quantization(requested, src, "m")
        assert expected in str(e.value)


def _requantized(tiny_llama: str, out: Path, qc: dict | None, rename: dict[str, str] | None = None) -> str:
    """A copy of the tiny llama whose config.json says `qc` (its tensors untouched, or renamed)."""
    shutil.copytree(tiny_llama, out)
    cfg = json.loads((out / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    if rename:
        from safetensors.torch import load_file, save_file

        tensors = load_file(out / "model.safetensors")
        for old, new in rename.items():
            tensors[new] = tensors.pop(old)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_quantized_tensors_without_a_config_are_refused(tiny_llama, tmp_path) -> None:
    model = _requantized(tiny_llama, tmp_path / "m", None,
                         {"model.layers.0.mlp.down_proj.weight": "model.layers.0.mlp.down_proj.weight_scale"})
    with pytest.raises(QuantizationError, match="weight_scale' is a quantized weight's part, but config.json has no"):
        Checkpoint(model)


def test_unsupported_checkpoint_refused_on_disk_load_and_by_cli(tiny_llama, tmp_path) -> None:
    bad = _with(W4A16, (*_W, "num_bits"), 2)["quantization_config"]
    model = _requantized(tiny_llama, tmp_path / "m", bad)
    from keepwarm import LLM

    with pytest.raises(QuantizationError, match="weights.num_bits = 2 is not supported"):
        LLM(model=model, daemon=False)
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": tempfile.mkdtemp(prefix="kwrt-", dir="/tmp")}  # no daemon there
    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "generate", "--model", model, "hi"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("error: quantization_config.config_groups.group_0.weights"
                                                          ".num_bits = 2"), out.stderr


# ---------------------------------------------------------------------------------------------- bad input, daemon
DATA = Path(__file__).resolve().parents[2] / "data" / "quantized"


def _edit_tensors(model: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(model / "model.safetensors")
    edit(t)
    save_file(t, model / "model.safetensors", metadata={"format": "pt"})


def _bad_checkpoint(case: str, tmp_path: Path) -> Path:
    import torch

    src = {"num_bits": "w4a16_g128", "missing_scale": "w4a16_g128", "scale_shape": "w4a16_asym_g32",
           "block_scale_shape": "fp8_block", "zero_point_shape": "w4a16_asym_g32"}[case]
    model = tmp_path / case
    shutil.copytree(DATA / src, model)
    p = "model.layers.1.mlp.down_proj."
    if case == "num_bits":
        cfg = json.loads((model / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
        (model / "config.json").write_text(json.dumps(cfg))
    elif case == "missing_scale":
        _edit_tensors(model, lambda t: t.pop(p + "weight_scale"))
    elif case == "scale_shape":
        _edit_tensors(model, lambda t: t.update({p + "weight_scale": t[p + "weight_scale"][:, :-1].contiguous()}))
    elif case == "block_scale_shape":
        _edit_tensors(model, lambda t: t.update({p + "weight_scale": torch.ones(3, 3, dtype=torch.bfloat16)}))
    else:
        _edit_tensors(model, lambda t: t.update({p + "weight_zero_point": t[p + "weight_zero_point"][:2].contiguous()}))
    return model


BAD_INPUTS = [
    ("num_bits", "quantization_config.config_groups.group_0.weights.num_bits = 2 is not supported"),
    ("missing_scale", "tensor model.layers.1.mlp.down_proj.weight_scale is missing (compressed-tensors int4"),
    ("scale_shape", "model.layers.1.mlp.down_proj.weight[0].weight_scale has shape [128, 7], expected [128, 8]"),
    ("block_scale_shape", "model.layers.1.mlp.down_proj.weight[0].weight_scale has shape [3, 3], expected [1, 2]"),
    ("zero_point_shape", "down_proj.weight[0].weight_zero_point has shape [2, 8], expected [128, 8]"),
]


@pytest.mark.slow
def test_bad_quantized_checkpoints_one_line_nothing_resident_daemon_serves(tmp_path) -> None:
    from keepwarm.daemon.client import DaemonError
    from keepwarm.formats import paths

    runtime = new_runtime_dir()
    d = DaemonProc(runtime).start()
    try:
        with d.client() as c:
            good = c.preload(str(DATA / "w8a16_channel"))
            for case, message in BAD_INPUTS:
                model = _bad_checkpoint(case, tmp_path)
                with pytest.raises(DaemonError) as e:
                    c.preload(str(model))
                assert e.value.code == "bad_quantization", (case, e.value.code, e.value.message)
                assert message in e.value.message and "\n" not in e.value.message, (case, e.value.message)
                assert [m["fingerprint"] for m in c.status()["models"]] == [good["fingerprint"]], case
                files = sorted(p.name for p in paths.shm_dir(runtime).iterdir())
                assert files == [f"{good['fingerprint']}.arena", f"{good['fingerprint']}.json"], (case, files)
            for flag in ("none", "int4"):  # never dequantized silently, never re-quantized into another scheme
                with pytest.raises(DaemonError, match=f"--quantization {flag} "):
                    c.preload(str(DATA / "fp8_dynamic"), quantization=flag)
            assert c.preload(str(DATA / "w8a16_channel"))["cached"] is True  # still serving what it held
        out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "preload", str(tmp_path / "scale_shape")],
                             env=d.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "weight_scale has shape" in lines[0], out.stderr
    finally:
        d.stop()
        remove_runtime_dir(runtime)
        shutil.rmtree(runtime, ignore_errors=True)
