"""The engine against transformers: greedy output must be token-for-token identical (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from support.inputs import make_prompts

from keepwarm import LLM, SamplingParams

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf_reference(tiny_model_factory):
    """Greedy continuations from transformers' generate, one prompt at a time (cached per model)."""
    import transformers

    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory(name),
                                                                      dtype=torch.float32)
            model.generation_config.eos_token_id = None  # ignore_eos: EOS may be generated but does not stop
            outs = []
            for p in make_prompts():
                ids = torch.tensor([p])
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_TOKENS, pad_token_id=0)
                outs.append(gen[0, len(p):].tolist())
            cache[name] = outs
        return cache[name]

    return get


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

ENGINE_VARIANTS = {
    "prefix_on": dict(enable_prefix_caching=True),
    "prefix_off": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=24),
    # 12 blocks of 16 hold about two of the longer requests: forces preemption by recompute.
    "preemption": dict(num_gpu_blocks=12, max_model_len=160),
    "block_size_32": dict(block_size=32),
}


NEW_FAMILIES = ["qwen3", "mistral_sw", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]
# Every variant for the Llama family; the paths that move KV around (prefix hits, chunks, recompute) for the rest.
GREEDY_CASES = [(m, v) for m in ["llama", "llama3_tied", "mistral", "qwen2"] for v in ENGINE_VARIANTS] + \
    [(m, v) for m in NEW_FAMILIES for v in ("prefix_on", "chunked_prefill", "preemption")]


@pytest.mark.parametrize(("model_name", "variant"), GREEDY_CASES)
def test_greedy_matches_transformers(tiny_model_factory, hf_reference, model_name: str, variant: str) -> None:
    kwargs = {"max_model_len": 256, **ENGINE_VARIANTS[variant]}
    llm = LLM(model=tiny_model_factory(model_name), dtype="float32", **kwargs)
    prompts = make_prompts()
    outs = llm.generate(prompts, GREEDY)
    expected = hf_reference(model_name)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
        assert out.outputs[0].finish_reason == "length"
    engine = llm.llm_engine
    if variant == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if variant == "chunked_prefill":
        assert engine.stats.steps > len(prompts) * 2  # prompts of up to 70 tokens took several steps
    # A second pass over the same prompts: with prefix caching on, most prompt blocks now hit.
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected
    bm = engine.block_manager
    if kwargs.get("enable_prefix_caching", True) and variant != "preemption":
        assert bm.prefix_cache_hits > 0
    if not kwargs.get("enable_prefix_caching", True):
        assert bm.prefix_cache_hits == 0
    assert bm.usage == 0.0  # everything freed


def test_output_independent_of_batch(tiny_llama) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompts = make_prompts(seed=3)
    target = prompts[7]
    alone = llm.generate([target], GREEDY)[0].outputs[0].token_ids
    for neighbours in (prompts[:4], prompts[10:], prompts[::3]):
        batch = neighbours[:2] + [target] + neighbours[2:]
        outs = llm.generate(batch, GREEDY)
        assert outs[2].outputs[0].token_ids == alone
    # Also under a tiny token budget, where the target's prefill is chunked next to other requests' decodes.
    chunked = LLM(model=tiny_llama, dtype="float32", max_model_len=256, max_num_batched_tokens=8)
    assert chunked.generate(prompts[:5] + [target], GREEDY)[5].outputs[0].token_ids == alone


def test_prefix_cache_reuses_three_blocks(tiny_llama) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, block_size=16)
    engine = llm.llm_engine
    rng = random.Random(1)
    shared = [rng.randrange(5, 500) for _ in range(48)]  # exactly 3 blocks
    first = shared + [rng.randrange(5, 500) for _ in range(7)]
    second = shared + [rng.randrange(5, 500) for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    llm.generate([first], params)
    hits_before = engine.block_manager.prefix_cache_hits
    queries_before = engine.block_manager.prefix_cache_queries
    blocks_seen: list[list[int]] = []
    original_allocate = engine.block_manager.allocate_slots

    def spy(seq, num_new, computed=None):
        ok = original_allocate(seq, num_new, computed)
        blocks_seen.append(engine.block_manager.get_block_ids(seq))
        return ok

    engine.block_manager.allocate_slots = spy
    out = llm.generate([second], params)[0]
    assert engine.block_manager.prefix_cache_hits - hits_before == 48
    assert engine.block_manager.prefix_cache_queries - queries_before == len(second)
    assert out.num_cached_tokens == 48
    # Its first three blocks are the cached ones: ids from the first request's table.
    assert len(blocks_seen[0]) == 4
    # And the result equals an uncached run.
    nocache = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    assert nocache.generate([second], params)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_prefix_cache_ids_are_the_first_requests_blocks(tiny_llama) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, block_size=16, num_gpu_blocks=32)
    engine = llm.llm_engine
    shared = list(range(10, 58))
    seen: dict[str, list[int]] = {}
    original_free = engine.block_manager.free

    def spy_free(seq):
        seen.setdefault(seq.seq_id, engine.block_manager.get_block_ids(seq))
        return original_free(seq)

    engine.block_manager.free = spy_free
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([shared + [100, 101]], params)
    llm.generate([shared + [200]], params)
    first, second = list(seen.values())
    assert first[:3] == second[:3]
    assert first[3:] != second[3:3 + len(first) - 3] or len(second) == 3


def test_prompt_longer_than_max_model_len_is_rejected(tiny_llama) -> None:
    from keepwarm.worker.engine import RequestError

    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=64)
    with pytest.raises(RequestError, match="maximum context length is 64"):
        llm.generate([list(range(5, 70))], GREEDY)
    # The engine keeps working and a request that reaches max_model_len stops with "length".
    out = llm.generate([list(range(5, 60))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    # A logit_bias id outside the vocabulary is refused before the request runs, not inside the sampler.
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(RequestError, match=f"logit_bias token ids must be in \\[0, {vocab}\\)"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    assert not llm.llm_engine.has_unfinished_requests()


def test_abort_frees_blocks(tiny_llama) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256)
    engine = llm.llm_engine
    engine.add_request("a", list(range(5, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(5, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.usage > 0
    assert engine.abort_request("a")
    assert engine.abort_request("b")
    assert not engine.abort_request("b")
    assert engine.block_manager.usage == 0.0
    assert not engine.has_unfinished_requests()
    assert engine.stats.finished["abort"] == 2


def test_sampling_features_end_to_end(tiny_llama) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256)
    prompt = list(range(5, 25))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    b = llm.generate([prompt, list(range(30, 90))], [seeded, seeded])[0].outputs[0].token_ids
    assert a == b  # per-request seed: reproducible whatever the batch
    greedy = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_id = greedy[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].token_ids == greedy[: greedy.index(stop_id) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[0]
    # vLLM's shape: per token {id: Logprob}, the sampled token first; greedy, so it is the top-1 (of 2)
    assert len(lp.logprobs) == 3 and all(len(x) == 2 for x in lp.logprobs)
    assert all(next(iter(x)) == t and x[t].rank == 1 for x, t in zip(lp.logprobs, lp.token_ids, strict=True))
    n3 = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert len(n3.outputs) == 3 and [o.index for o in n3.outputs] == [0, 1, 2]


def test_stop_string_truncates_text(tiny_llama) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256)
    prompt = list(range(5, 25))
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = full.text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()), None)
    assert stop is not None
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop],
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_fp8_kv_cache_runs_close_to_auto(tiny_llama) -> None:
    auto = LLM(model=tiny_llama, dtype="float32", max_model_len=256)
    fp8 = LLM(model=tiny_llama, dtype="float32", max_model_len=256, kv_cache_dtype="fp8")
    assert fp8.llm_engine.runner.kv_cache.key[0].dtype == torch.float8_e4m3fn
    prompts = make_prompts()
    a = [o.outputs[0].token_ids for o in auto.generate(prompts, GREEDY)]
    b = [o.outputs[0].token_ids for o in fp8.generate(prompts, GREEDY)]
    # fp8 rounds K/V to 3 mantissa bits: outputs may drift, but the first tokens mostly agree.
    first_agree = sum(x[0] == y[0] for x, y in zip(a, b, strict=True))
    assert first_agree >= 12, first_agree


@pytest.mark.parametrize("budget", [None, 16])
def test_prompt_logprobs_match_transformers(tiny_llama, budget) -> None:
    import transformers

    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, max_num_batched_tokens=budget)
    prompt = make_prompts()[13]  # 55 tokens: several chunks under a budget of 16
    llm.generate([prompt], GREEDY)  # its blocks are now cached: prompt logprobs must not use the hits
    out = llm.generate([prompt, make_prompts()[2]], SamplingParams(temperature=0, max_tokens=2,
                                                                  prompt_logprobs=3))[0]
    lps = out.prompt_logprobs
    assert lps[0] is None and len(lps) == len(prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):  # vLLM's shape: {id: Logprob}, the prompt token first, then the top-3
        assert next(iter(lps[i])) == prompt[i]
        assert abs(lps[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        top = sorted((x.rank, t) for t, x in lps[i].items() if x.rank is not None and x.rank <= 3)
        assert [t for _, t in top] == ref[i - 1].topk(3).indices.tolist()
