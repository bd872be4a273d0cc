"""A tied GGUF head in bfloat16 is the file's own quantized token_embd blocks, converted as a projection (the loader's
derived ``lm_head``): the int8_group or int4 layout, the codes of the file, and fewer bytes than a dense bf16 head; in
float32 the model multiplies by the embedding as before."""

from __future__ import annotations

import pytest
import torch
from support.tiny_gguf import HIDDEN, VOCAB, tiny_gguf_dir

from keepwarm.formats.quant import LAYOUT_INT8_GROUP
from keepwarm.kernels.quant import QuantizedWeight
from keepwarm.worker.llm import LLM

LAYER = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_0", "ffn_down": "Q8_0"}


@pytest.mark.parametrize("embed_type, scheme", [("Q8_0", "int8_group"), ("Q6_K", "int8_group"), ("Q4_0", "int4")])
def test_tied_head_is_the_files_quantized_embedding(tiny_llama, tmp_path, embed_type: str, scheme: str) -> None:
    path, expected = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, [LAYER], embed_type=embed_type)
    llm = LLM(model=str(path), dtype="bfloat16", daemon=False, max_model_len=64)
    try:
        model = llm.llm_engine.loaded.model
        head = model.lm_head.weight
        assert isinstance(head, QuantizedWeight) and head.meta.scheme == scheme
        assert tuple(head.shape) == (VOCAB, HIDDEN)
        assert head.nbytes < VOCAB * HIDDEN * 2  # fewer bytes a step than the dense bf16 embedding
        # The file's codes: dequantized in float32 with the scales as stored (bf16), the gguf package's values
        # within bf16's rounding of a scale; the embedding lookup keeps its own dense rows.
        dense = expected["model.embed_tokens.weight"]
        got = head.dequantize(torch.float32)
        assert torch.allclose(got, dense, rtol=2 ** -7, atol=1e-6)
        assert not torch.equal(got, torch.zeros_like(got))
        if scheme == "int8_group":  # the file's own codes, signed as stored (Q6_K: -32..31 over groups of 16)
            gs = 16 if embed_type == "Q6_K" else 32
            assert head.meta.layout == LAYOUT_INT8_GROUP and head.meta.group_size == gs
        tokens = llm.generate([{"prompt_token_ids": [5, 17, 99, 240, 7]}])[0].outputs[0].token_ids
        assert len(tokens) > 0 and all(0 <= t < VOCAB for t in tokens)
    finally:
        llm.close()


def test_float32_multiplies_by_the_embedding(tiny_llama, tmp_path) -> None:
    path, _ = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, [LAYER], embed_type="Q8_0")
    llm = LLM(model=str(path), dtype="float32", daemon=False, max_model_len=64)
    try:
        model = llm.llm_engine.loaded.model
        assert model.lm_head.weight is model.model.embed_tokens.weight  # exact in float32: no second copy
    finally:
        llm.close()
