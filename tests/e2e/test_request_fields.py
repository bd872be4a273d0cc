"""Request fields a vLLM user sends (issue 46, point 5): ``logit_bias``, ``echo`` with ``max_tokens: 0``, and the
Responses API's store (``previous_response_id``, ``GET /v1/responses/{id}``), behind vLLM's switch.

The fast tests check the parts alone (the sampler's bias, SamplingParams' limits, the schema's token-id pattern,
the store's bounds); the slow ones run two real `keepwarm serve` processes on the tiny random llama (vocabulary 512)
driven by the official openai client: one with the store turned on by vLLM's environment variable, one where
``--no-enable-responses-store`` turns it off though that variable says 1 (the flag is the same switch, and wins).
"""

from __future__ import annotations

import concurrent.futures
import math
import re
import time
from typing import Any

import httpx
import openai
import pytest
import torch
from support.serve import ServeProcess
from support.wait import wait_until

from keepwarm.worker.engine.sequence import Sequence
from keepwarm.worker.http.openapi import decimal_below
from keepwarm.worker.openai.responses import ResponseStore
from keepwarm.worker.sampler import Sampler
from keepwarm.worker.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams, SamplingParamsError

VOCAB = 512  # the tiny llama's
SWITCH = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


# -- fast: the parts alone ---------------------------------------------------------------------------------------
def _sample(logits: torch.Tensor, params: list[SamplingParams], prompt: list[int] | None = None):
    seqs = [Sequence(f"s{i}", prompt or [1, 2, 3], p) for i, p in enumerate(params)]
    return Sampler().sample(logits, seqs)


def test_the_sampler_adds_a_rows_bias_and_leaves_the_other_rows_alone() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 64)
    before = logits.clone()
    top2 = logits[2].topk(2).indices.tolist()
    out = _sample(logits, [SamplingParams(temperature=0, logit_bias={7: 100.0}),
                           SamplingParams(temperature=0),
                           SamplingParams(temperature=0, logprobs=3, logit_bias={top2[0]: -100.0}),
                           SamplingParams(temperature=0, logit_bias={"11": 0.5})])
    assert out.token_ids[0] == 7  # +100 forces a token
    assert out.token_ids[1] == int(logits[1].argmax())  # no bias: the row's own argmax
    assert out.token_ids[2] == top2[1]  # -100 bans the greedy token: the runner-up
    shifted = logits[3].clone()
    shifted[11] += 0.5
    assert out.token_ids[3] == int(shifted.argmax())  # a small bias is an exact add
    # The logprobs stay the model's (vLLM's default raw_logprobs): the ban changes the token, not its logprob.
    raw = torch.log_softmax(logits[2], dim=-1)
    lp = out.logprobs[2]
    assert lp.token_id == top2[1] and lp.logprob == pytest.approx(float(raw[top2[1]]), abs=1e-6) and lp.rank == 2
    assert [t for t, _ in lp.top] == raw.topk(3).indices.tolist()
    assert torch.equal(logits, before)  # the caller's tensor is untouched


def test_the_bias_comes_before_the_repetition_penalty_as_in_vllm() -> None:
    # Token 5 (in the prompt, so penalized) at 1.0, token 6 at 1.5, bias +2 on token 5, repetition penalty 4.
    # vLLM: (1.0 + 2) / 4 = 0.75 < 1.5, token 6. The other order would give 1.0 / 4 + 2 = 2.25, token 5.
    logits = torch.full((1, 16), -5.0)
    logits[0, 5], logits[0, 6] = 1.0, 1.5
    out = _sample(logits, [SamplingParams(temperature=0, repetition_penalty=4.0, logit_bias={5: 2.0})], [5])
    assert out.token_ids == [6]


def test_an_offline_bias_outside_the_vocabulary_fails_its_row_by_name() -> None:
    with pytest.raises(ValueError, match="logit_bias token id 64 is outside the vocabulary"):
        _sample(torch.zeros(1, 64), [SamplingParams(temperature=0, logit_bias={64: 1.0})])


@pytest.mark.parametrize("bias, words", [
    ({str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, "301 entries (limit 300)"),
    ({5: 100.5}, "logit_bias[5] must be a number in [-100, 100]"),
    ({5: -math.inf}, "in [-100, 100]"),
    ({5: math.nan}, "in [-100, 100]"),
    ({5: True}, "in [-100, 100]"),
    ({-1: 1.0}, "must be token ids"),
    ({"five": 1.0}, "must be token ids"),
    ({"9" * 5000: 1.0}, "must be token ids"),
], ids=["entries", "above", "-inf", "nan", "bool", "negative", "word", "huge"])
def test_sampling_params_hold_openais_logit_bias_limits(bias: dict, words: str) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.field == "logit_bias" and words in str(e.value) and len(str(e.value)) < 200


def test_sampling_params_take_vllms_key_forms() -> None:
    assert SamplingParams(logit_bias={"5": -100, 7: 100.0}).logit_bias == {5: -100, 7: 100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    edge = {str(i): 100.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}
    assert len(SamplingParams(logit_bias=edge).logit_bias or {}) == MAX_LOGIT_BIAS_ENTRIES


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 100, 101, 512, 1000, 32000, 49152, 151936])
def test_the_schema_pattern_is_exactly_the_vocabularys_ids(n: int) -> None:
    pattern = re.compile(f"^{decimal_below(n)}$")
    for k in {*range(0, min(n + 20, 2100)), *range(max(0, n - 2100), n + 20)}:
        assert bool(pattern.match(str(k))) == (k < n), (n, k)
    for bad in ("", "00", "01", "-1", "+1", "1.0", " 1", "1 "):
        assert not pattern.match(bad), (n, bad)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _response(rid: str, text: str = "x") -> dict[str, Any]:
    return {"id": rid, "object": "response", "output": [{"type": "message", "content": text}]}


def test_the_response_store_is_bounded_by_count_bytes_and_age() -> None:
    clock = Clock()
    store = ResponseStore(max_responses=3, max_bytes=1000, ttl_s=60.0, clock=clock)
    for i in range(4):  # the count: the oldest goes first
        assert store.put(_response(f"resp_{i}"), [{"role": "user", "content": "hi"}])
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_1") is not None
    small = store.nbytes // 3
    # The bytes: a big response pushes out as many of the oldest as it needs (the count takes resp_1, the bytes
    # resp_2 too: two small ones and the big one are past the bound, one small and the big one are not).
    assert store.put(_response("resp_big", "y" * 700), [])
    big = store.get("resp_big").nbytes  # type: ignore[union-attr]
    assert 2 * small + big > 1000 >= small + big == store.nbytes
    assert store.get("resp_1") is None and store.get("resp_2") is None and store.get("resp_3") is not None
    # One response over the bound alone is not kept, and pushes nothing out.
    assert not store.put(_response("resp_huge", "z" * 1200), [])
    assert store.get("resp_huge") is None and store.get("resp_big") is not None
    # The age: gone once older than the TTL, and its bytes with it.
    clock.now += 30
    assert store.put(_response("resp_new"), [])
    clock.now += 31  # resp_3 and resp_big are 61 s old, resp_new 31 s
    assert store.get("resp_big") is None and store.get("resp_3") is None and store.get("resp_new") is not None
    assert len(store) == 1 and store.nbytes == store.get("resp_new").nbytes  # type: ignore[union-attr]
    # The same id again replaces the entry (its bytes counted once).
    assert store.put(_response("resp_new", "w"), [])
    assert len(store) == 1 and store.nbytes == store.get("resp_new").nbytes  # type: ignore[union-attr]


# -- slow: real servers ------------------------------------------------------------------------------------------
class Served(ServeProcess):
    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(model, "--no-daemon", "--dtype", "float32", "--max-model-len", "256", "--threads", "1",
                         "--served-model-name", "tiny", *args, env=env)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/{route}", json={"model": "tiny", **body}, timeout=120)

    def detokenize(self, ids: list[int]) -> str:
        return httpx.post(self.base + "/detokenize", json={"tokens": ids}).json()["prompt"]

    def tokenize(self, text: str) -> list[int]:
        return httpx.post(self.base + "/tokenize", json={"prompt": text}).json()["tokens"]

    def steps(self) -> float:
        return self.metric("keepwarm:engine_steps")

    def steps_since(self, before: float) -> float:
        """Engine steps run since ``before`` once the engine is idle again (the figure is published after the step
        delivers its outputs, so it may lag the answer a moment)."""
        wait_until(lambda: self.steps() != before, 10, strict=False)
        time.sleep(0.6)  # past the idle loop's next publication: a later step would show by now
        return self.steps() - before


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The store on through vLLM's environment variable alone."""
    s = Served(tiny_llama, env=SWITCH)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def stateless(tiny_llama):
    """vLLM's variable says 1, the flag says no: the flag wins, the store is off."""
    s = Served(tiny_llama, "--no-enable-responses-store", env=SWITCH)
    yield s
    assert s.stop() == 0


PROMPT = [363, 323, 390, 511, 82]  # "The quick brown" in the tiny tokenizer


def ranked_next(server: Served, prompt: list[int], k: int = 2) -> tuple[list[int], dict[str, Any]]:
    """The k most likely token ids after ``prompt`` and their prompt-logprob entry (vLLM's prompt_logprobs on the
    prompt plus one token: its last entry is the distribution after ``prompt``)."""
    r = server.post("completions", {"prompt": [*prompt, 0], "max_tokens": 1, "prompt_logprobs": k})
    assert r.status_code == 200, r.text
    last = r.json()["choices"][0]["prompt_logprobs"][-1]
    ranked = sorted((v["rank"], int(t)) for t, v in last.items() if v["rank"] <= k)
    return [t for _, t in ranked], last


@pytest.mark.slow
def test_logit_bias_forces_and_bans_tokens_and_the_batch_beside_is_unaffected(server) -> None:
    (greedy, second), _ = ranked_next(server, PROMPT)
    forced = 69
    assert forced not in (greedy, second)

    def complete(bias: dict[str, float] | None, **extra: Any) -> Any:
        return server.client.completions.create(model="tiny", prompt=PROMPT, temperature=0, logit_bias=bias,
                                                **{"max_tokens": 4, **extra})

    reference = complete(None).choices[0].text
    # Greedy, each alongside the others (the engine batches what arrives together): an unbiased request beside
    # biased ones still gives its reference.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(complete, b) for b in ({str(forced): 100}, None, {str(greedy): -100}, None,
                                                   {str(forced): 100}, None)]
        texts = [j.result().choices[0].text for j in jobs]
    assert texts[0] == texts[4] == server.detokenize([forced] * 4)  # +100 forces it at every step
    assert texts[1] == texts[3] == texts[5] == reference and texts[2] != reference
    banned = complete({str(greedy): -100}, max_tokens=1).choices[0].text
    assert banned == server.detokenize([second])  # -100 on the greedy token: the runner-up instead
    # The logprob reported for the forced token is the model's own (vLLM's default), not the biased ~0.
    lps = complete({str(forced): 100}, max_tokens=1, logprobs=1).choices[0].logprobs
    raw = server.post("completions", {"prompt": [*PROMPT, forced], "max_tokens": 1, "prompt_logprobs": 0})
    raw_lp = raw.json()["choices"][0]["prompt_logprobs"][-1][str(forced)]["logprob"]
    assert lps.token_logprobs[0] == pytest.approx(raw_lp, abs=1e-4) and lps.token_logprobs[0] < -1
    # Chat takes it too.
    chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == server.detokenize([forced] * 3)
    assert chat.choices[0].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("route, bias, words", [
    ("completions", {str(i): 1 for i in range(301)}, "301 entries (limit 300)"),
    ("completions", {"5": 100.5}, "less than or equal to 100"),
    ("completions", {"5": -101}, "greater than or equal to -100"),
    ("completions", {"five": 1}, "logit_bias.five"),
    ("completions", {"512": 1}, "[512] are outside the vocabulary (ids are in [0, 512))"),
    ("chat/completions", {"600": 1, "7": 1}, "[600] are outside the vocabulary"),
    ("chat/completions", {"5": 1000}, "less than or equal to 100"),
], ids=["entries", "above", "below", "word", "vocab", "chat-vocab", "chat-above"])
def test_logit_bias_past_its_limits_is_a_400_naming_it(server, route: str, bias: dict, words: str) -> None:
    body = {"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = server.post(route, {**body, "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and words in err["message"] and "\n" not in err["message"], err


@pytest.mark.slow
def test_echo_with_max_tokens_0_scores_the_prompts_without_a_decode_step(server) -> None:
    prompts = ["The quick brown fox", "Hello world"]
    ids = [server.tokenize(p) for p in prompts]
    steps = server.steps()
    r = server.client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=2, n=2)
    assert server.steps_since(steps) == 1  # one prefill step for both prompts, nothing decoded
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert {c.finish_reason for c in r.choices} == {"length"}
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(map(len, ids)), 0)
    for c, tokens in zip(r.choices, [ids[0], ids[0], ids[1], ids[1]], strict=True):
        lp = c.logprobs
        assert len(lp.tokens) == len(tokens) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        # top_logprobs are keyed by text: two byte tokens may decode alike ("\ufffd"), so at most 2 keys
        assert all(x < 0 for x in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
        assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    # lm-eval's local-completions sends max_tokens 1 with echo (lm_eval 0.4.13, LocalCompletionsAPI) and sums
    # token_logprobs[ctxlen:-1], dropping the one generated token: the same numbers as max_tokens 0's prompt.
    one = server.post("completions", {"prompt": [ids[0]], "max_tokens": 1, "echo": True, "logprobs": 1,
                                      "temperature": 0, "seed": 1234}).json()["choices"][0]["logprobs"]
    zero = server.post("completions", {"prompt": [ids[0]], "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    scored = zero["choices"][0]["logprobs"]
    assert len(one["token_logprobs"]) == len(ids[0]) + 1 and len(scored["token_logprobs"]) == len(ids[0])
    assert one["token_logprobs"][:-1] == scored["token_logprobs"] and one["top_logprobs"][:-1] == \
        scored["top_logprobs"]
    # (the two-prompt request above prefilled both prompts in one batch: the same numbers to float rounding)
    assert scored["token_logprobs"][1:] == pytest.approx(r.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    ctxlen = 2
    assert sum(one["token_logprobs"][ctxlen:-1]) == sum(scored["token_logprobs"][ctxlen:])
    # Without logprobs: the prompt alone; vLLM's prompt_logprobs come along when asked.
    bare = server.post("completions", {"prompt": "Hello world", "max_tokens": 0, "echo": True,
                                       "prompt_logprobs": 1}).json()["choices"][0]
    assert bare["text"] == "Hello world" and bare["logprobs"] is None
    assert bare["prompt_logprobs"][0] is None and len(bare["prompt_logprobs"]) == len(ids[1])


@pytest.mark.slow
def test_echo_with_max_tokens_0_streams_one_chunk_per_choice(server) -> None:
    prompts = ["The quick brown fox", "Hello world"]
    whole = server.client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    chunks = list(server.client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True,
                                                   logprobs=1, stream=True, stream_options={"include_usage": True}))
    choices = sorted((c for chunk in chunks for c in chunk.choices), key=lambda c: c.index)
    assert [c.text for c in choices] == prompts and {c.finish_reason for c in choices} == {"length"}
    assert [c.logprobs.token_logprobs for c in choices] == [c.logprobs.token_logprobs for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("body, param, words", [
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1 (0 only with echo: true"),
    ({"max_tokens": 0, "echo": False}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "between 0 and max_tokens"),
    ({"max_tokens": 0, "echo": True, "seed": 1 << 63}, "seed", "less than or equal to"),
], ids=["no-echo", "echo-false", "min_tokens", "seed"])
def test_max_tokens_0_needs_echo_and_the_rest_still_holds(server, body: dict, param: str, words: str) -> None:
    r = server.post("completions", {"prompt": "hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], \
        r.text


def _text_of(response: Any) -> str:
    return "".join(part.text for item in response.output if item.type == "message" for part in item.content)


@pytest.mark.slow
def test_previous_response_id_continues_the_stored_conversation(server) -> None:
    c = server.client
    common: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_output_tokens": 6}
    first = c.responses.create(input="Hi there", instructions="Answer in one word.", **common)
    assert first.store is True and _text_of(first)
    got = c.responses.retrieve(first.id)
    assert (got.id, _text_of(got), got.usage.input_tokens) == (first.id, _text_of(first), first.usage.input_tokens)
    second = c.responses.create(previous_response_id=first.id, input="And then?", **common)
    assert second.previous_response_id == first.id
    # The same conversation sent whole, statelessly: the first input and output before the new input, and the
    # first request's instructions not carried over (OpenAI's rule).
    whole = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": _text_of(first)},
             {"role": "user", "content": "And then?"}]
    reference = c.responses.create(input=whole, store=False, **common)
    assert (_text_of(second), second.usage.input_tokens) == (_text_of(reference), reference.usage.input_tokens)
    third = c.responses.create(previous_response_id=second.id, input="Why?", **common)
    again = c.responses.create(input=[*whole, {"role": "assistant", "content": _text_of(second)},
                                      {"role": "user", "content": "Why?"}], store=False, **common)
    assert (_text_of(third), third.usage.input_tokens) == (_text_of(again), again.usage.input_tokens)
    # store: false keeps nothing, so nothing continues from it.
    assert reference.store is False
    with pytest.raises(openai.NotFoundError, match="not found"):
        c.responses.retrieve(reference.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(previous_response_id=reference.id, input="x", **common)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.slow
def test_a_streamed_response_is_stored_and_continued(server) -> None:
    c = server.client
    events = list(c.responses.create(model="tiny", input="Count to three.", max_output_tokens=5, temperature=0,
                                     stream=True))
    final = events[-1].response
    assert events[0].response.store is True and final.store is True
    assert c.responses.retrieve(final.id).output_text == final.output_text
    follow = c.responses.create(model="tiny", previous_response_id=final.id, input="Again.", max_output_tokens=3,
                                temperature=0)
    assert follow.usage.input_tokens > final.usage.input_tokens


@pytest.mark.slow
def test_the_store_off_refuses_in_one_line_naming_the_switch(server, stateless) -> None:
    c = stateless.client
    done = c.responses.create(model="tiny", input="hi", max_output_tokens=2, store=True)
    assert done.store is False  # store asked for, but nothing is kept (as vLLM, with one warning in the log)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="hi", max_output_tokens=2, previous_response_id=done.id)
    err = e.value.body
    assert err["param"] == "previous_response_id" and "\n" not in err["message"]  # type: ignore[index]
    for switch in ("--enable-responses-store", "VLLM_ENABLE_RESPONSES_API_STORE=1"):
        assert switch in err["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError, match="--enable-responses-store"):
        c.responses.retrieve(done.id)
    # Each server says what it runs with, and its schema lists the stored-response route only with the store.
    assert httpx.get(stateless.base + "/keepwarm/config").json()["config"]["enable_responses_store"] is False
    assert httpx.get(server.base + "/keepwarm/config").json()["config"]["enable_responses_store"] is True
    off, on = (httpx.get(s.base + "/openapi.json").json() for s in (stateless, server))
    assert "/v1/responses/{response_id}" not in off["paths"] and "/v1/responses/{response_id}" in on["paths"]
    previous = off["components"]["schemas"]["ResponsesRequest"]["properties"]["previous_response_id"]
    assert previous == {"type": "null"}
    with pytest.raises(openai.NotFoundError, match="not found"):
        server.client.responses.retrieve("resp_nothing")


@pytest.mark.slow
def test_the_schema_states_the_new_fields(server) -> None:
    bodies = httpx.get(server.base + "/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        bias = next(s for s in bodies[name]["properties"]["logit_bias"]["anyOf"] if s.get("type") == "object")
        pattern = re.compile(bias["propertyNames"]["pattern"])
        assert pattern.match("511") and not pattern.match("512") and not pattern.match("05")
        assert bias["maxProperties"] == MAX_LOGIT_BIAS_ENTRIES
        assert (bias["additionalProperties"]["minimum"], bias["additionalProperties"]["maximum"]) == (-100, 100)
    # max_tokens 0 is stated with echo (and no structured output); every other branch says at least 1.
    completion = bodies["CompletionRequest"]
    assert next(s for s in completion["properties"]["max_tokens"]["anyOf"] if s["type"] == "integer")["minimum"] == 0
    rule = next(r for r in completion["allOf"] if any(b["properties"].get("echo") == {"const": True}
                                                      for b in r.get("anyOf", [])))
    at_least_one = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
    assert all(b["properties"]["max_tokens"] == at_least_one for b in rule["anyOf"] if "echo" not in b["properties"])
    previous = bodies["ResponsesRequest"]["properties"]["previous_response_id"]
    assert previous == {"type": ["string", "null"]}
