"""Regenerate the tiny compressed-tensors checkpoints beside this file with llm-compressor itself.

llm-compressor pins an older transformers than keepwarm, so it runs in a virtual environment of its own, OUTSIDE
the repository (the repository root's `kernels/` folder shadows a package transformers probes):

    python3 -m venv /work/lc-venv && /work/lc-venv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    .venv/bin/python -c "from keepwarm.worker.models.random_model import make_random_model as m; \\
        m('/tmp/ct-base', 'llama', tie_word_embeddings=True, head_dim=32, dtype='bfloat16', seed=3)"
    cd /tmp && /work/lc-venv/bin/python $REPO/tests/data/quantized/make_checkpoints.py /tmp/ct-base \\
        $REPO/tests/data/quantized

Data-free schemes run llm-compressor's QuantizationModifier (round to nearest, min-max observers); the actorder
one runs its GPTQModifier on a few random token sequences (calibration data only steers the rounding: the
checkpoint is what it is, and the tests compare keepwarm with transformers on the same file).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch


def _args(num_bits: int, type_: str = "int", symmetric: bool = True, strategy: str = "group",
          group_size: int | None = None, block: list[int] | None = None, actorder: str | None = None):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=num_bits, type=type_, symmetric=symmetric, strategy=strategy,
                            group_size=group_size, block_structure=block, actorder=actorder)


def _scheme(weights, input_activations=None):
    from compressed_tensors.quantization import QuantizationScheme

    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=input_activations)}


def cases() -> dict[str, tuple[str, object]]:
    """name -> (modifier, preset scheme name or config groups)."""
    return {
        "w4a16_g128": ("rtn", "W4A16"),
        "w4a16_asym_g32": ("rtn", _scheme(_args(4, symmetric=False, group_size=32))),
        "w4a16_channel": ("rtn", _scheme(_args(4, strategy="channel"))),
        "w8a16_g128": ("rtn", "W8A16"),
        "w8a16_channel": ("rtn", _scheme(_args(8, strategy="channel"))),
        "w8a16_asym_g64": ("rtn", _scheme(_args(8, symmetric=False, group_size=64))),
        "fp8_dynamic": ("rtn", "FP8_DYNAMIC"),
        "fp8_block": ("rtn", "FP8_BLOCK"),
        "fp8_tensor": ("rtn", _scheme(_args(8, "float", strategy="tensor"))),
        "w4a16_actorder_weight": ("gptq", _scheme(_args(4, group_size=32, actorder="weight"))),
    }


def main(base: str, out_root: str, only: list[str]) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    for name, (kind, scheme) in cases().items():
        if only and name not in only:
            continue
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        groups = {"scheme": scheme} if isinstance(scheme, str) else {"config_groups": scheme}
        if kind == "rtn":
            oneshot(model=model, recipe=QuantizationModifier(targets="Linear", ignore=["lm_head"], **groups))
        else:
            g = torch.Generator().manual_seed(0)
            ids = [torch.randint(3, 500, (32,), generator=g).tolist() for _ in range(8)]
            ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32 for _ in ids]})
            oneshot(model=model, dataset=ds, recipe=GPTQModifier(targets="Linear", ignore=["lm_head"], **groups),
                    num_calibration_samples=8, max_seq_length=32)
        out = Path(out_root) / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, save_compressed=True)
        for f in Path(base).iterdir():  # tokenizer, chat template, generation config
            if f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, out / f.name)
        print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
