"""Linear rope scaling (`rope_type: linear`, README's "linear rope"): greedy tokens equal transformers' in float32,
and the scaling is really applied (the same model without it answers differently)."""

from __future__ import annotations

import json

from support.references import MAX_TOKENS, hf_greedy, load_hf

from keepwarm import LLM, SamplingParams
from keepwarm.formats.model_config import load_model_config
from keepwarm.worker.models.random_model import make_random_model

PROMPTS = [[5, 6, 7], list(range(20, 90)), [300 + (i * 7) % 200 for i in range(120)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hf_greedy(model_dir) -> list[list[int]]:
    return hf_greedy(load_hf(model_dir), PROMPTS)


def test_linear_rope_matches_transformers(tmp_path) -> None:
    scaled = make_random_model(tmp_path / "linear", "llama", head_dim=32, seed=3,
                               rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    assert load_model_config(scaled).rope.rope_type == "linear"
    llm = LLM(model=str(scaled), dtype="float32", max_model_len=256, daemon=False)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == _hf_greedy(scaled)
    # Without the scaling the same weights answer differently somewhere: the test can tell linear from none.
    cfg_path = scaled / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg_path.write_text(json.dumps(cfg))
    plain = LLM(model=str(scaled), dtype="float32", max_model_len=256, daemon=False)
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)] != got
