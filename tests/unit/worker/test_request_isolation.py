"""One bad request must never take the server down: boundary validation, engine isolation, bounded templates,
thread-count-independent packing (in-process; the end-to-end table is tests/e2e/test_hostile_requests.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pydantic
import pytest
import torch
import torch.nn.functional as F
from support.wait import wait_until

from keepwarm import LLM, SamplingParams
from keepwarm.worker.engine import EngineDeadError
from keepwarm.worker.openai.protocol import ChatCompletionRequest, CompletionRequest, unencodable_path
from keepwarm.worker.sampling_params import SamplingParamsError
from keepwarm.worker.tokenizer import TEMPLATE_CACHE_SIZE, FastTokenizer, TemplateLimitError

BASE = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}

# (body, the field the error must name): each was accepted before, and either crashed the engine, answered with
# garbage, or took a boolean for a number (issue 17's table, items 1, 6, 7, 10).
REFUSED = [
    ({**BASE, "seed": 18446744073709551616}, "seed"),
    ({**BASE, "seed": -(1 << 63) - 1}, "seed"),
    ({**BASE, "temperature": float("nan")}, "temperature"),
    ({**BASE, "repetition_penalty": float("nan")}, "repetition_penalty"),
    ({**BASE, "top_p": float("inf")}, "top_p"),
    ({**BASE, "presence_penalty": float("-inf")}, "presence_penalty"),
    ({**BASE, "prompt": [[False]]}, "prompt"),
    ({**BASE, "prompt": [True, 5]}, "prompt"),
    ({**BASE, "max_tokens": True}, "max_tokens"),
    ({**BASE, "n": True}, "n"),
    ({**BASE, "stop_token_ids": [False]}, "stop_token_ids"),
    ({**BASE, "prompt": [[]]}, "prompt"),
    ({**BASE, "prompt": "ab\ud800cd"}, "prompt"),
    ({**BASE, "model": "ti\udfffny"}, "model"),
    ({**BASE, "request_id": "\ud800"}, "request_id"),
    ({**BASE, "stop": ["ok", "\udc00"]}, "stop.1"),
]
CHAT_REFUSED = [
    ({**CHAT, "messages": [{"role": "user", "content": "ab\ud800cd"}]}, "messages.0.content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ({**CHAT, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs"),
    ({**CHAT, "temperature": float("nan")}, "temperature"),
    ({**CHAT, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
]


def _refusal(model: type[pydantic.BaseModel], body: dict) -> str:
    # The server parses JSON with Python's json module, which turns "\ud800" escapes into lone surrogates and
    # accepts NaN/Infinity: round-trip the body the way a client would send it.
    data = json.loads(json.dumps(body))
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(data)
    err = info.value.errors()[0]
    return ".".join(str(x) for x in err["loc"]) + " " + str(err["msg"])


@pytest.mark.parametrize("body, field", REFUSED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(REFUSED)])
def test_completion_boundary_refuses(body, field) -> None:
    assert field in _refusal(CompletionRequest, body)


@pytest.mark.parametrize("body, field", CHAT_REFUSED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(CHAT_REFUSED)])
def test_chat_boundary_refuses(body, field) -> None:
    assert field in _refusal(ChatCompletionRequest, body)


def test_boundary_accepts_the_edges() -> None:
    req = CompletionRequest.model_validate({**BASE, "seed": (1 << 63) - 1, "prompt": [[1, 2], [3]],
                                            "temperature": 0, "top_k": -1, "stop_token_ids": [0]})
    assert req.sampling(2, None, 2).seed == (1 << 63) - 1
    assert CompletionRequest.model_validate({**BASE, "prompt": "héllo 🙂"}).prompt == "héllo 🙂"
    # seed + i must stay a generator seed for every choice of an n > 1 request
    with pytest.raises(SamplingParamsError, match="seed"):
        CompletionRequest.model_validate({**BASE, "seed": (1 << 63) - 1, "n": 2}).sampling(2, None, 2)


def test_unencodable_path_names_keys_and_values() -> None:
    assert unencodable_path({"a": [{"b": "ok"}, {"c": "x\ud800"}]}) == "a.1.c"
    assert unencodable_path({"k": {"\udfff": 1}}) == "k"
    assert unencodable_path({"a": ["fine", 1, 2.5, None]}) is None


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("repetition_penalty", float("nan")),
                                          ("top_p", float("inf")), ("seed", 1 << 64), ("seed", True)])
def test_sampling_params_refuse_what_the_sampler_cannot_run(field, value) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


# -- the engine ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=128, daemon=False)
    yield llm
    llm.close()


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _run_until_done(engine) -> dict[str, object]:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_a_request_that_breaks_the_sampler_fails_alone(llm, caplog) -> None:
    """Issue 17 item 1 inside the engine: a seed torch cannot take (slipped past validation) broke the sampler
    for the whole batch and killed the engine thread. Now that request fails, the others finish exactly."""
    engine = llm.llm_engine
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    reference = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    engine.add_request("good-0", prompts[0], GREEDY)
    engine.add_request("bad", prompts[1], sampled)
    engine.add_request("good-2", prompts[2], GREEDY)
    engine.output_processor.requests["bad"].seqs[0].sampling_params.seed = 1 << 64  # as a request could before issue 17
    with caplog.at_level(logging.ERROR, logger="keepwarm.worker"):
        final = _run_until_done(engine)
    assert final["bad"].error and "Overflow" in final["bad"].error
    assert final["bad"].outputs[0].finish_reason == "abort"
    assert [final[r].outputs[0].token_ids for r in ("good-0", "good-2")] == [reference[0], reference[2]]
    assert final["good-0"].error is None
    assert any("request bad failed inside the engine" in r.getMessage() for r in caplog.records)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and not engine.output_processor.seq_to_request


def test_a_request_whose_detokenizer_breaks_fails_alone(llm) -> None:
    engine = llm.llm_engine
    engine.add_request("ok", [5, 6, 7], GREEDY)
    engine.add_request("broken", [8, 9], GREEDY)

    class Broken:
        def step(self, ids):
            raise UnicodeError("injected")

    engine.output_processor.requests["broken"].detoks[0] = Broken()
    final = _run_until_done(engine)
    assert "UnicodeError: injected" in final["broken"].error
    assert len(final["ok"].outputs[0].token_ids) == 8 and final["ok"].error is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_failed_forward_is_fatal_and_says_so(tiny_llama, monkeypatch) -> None:
    """What every request shares cannot be blamed on one: the engine raises EngineDeadError, the async front
    fails every waiting request, reports not running, and calls on_fatal once (the server then exits non-zero)."""
    from keepwarm.worker.async_engine import AsyncEngine
    from keepwarm.worker.engine import EngineConfig, LLMEngine

    fatal: list[BaseException] = []
    async_engine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama, dtype="float32",
                                                              max_model_len=64, daemon=False)),
                               on_fatal=fatal.append)

    def boom(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(async_engine.engine.runner, "execute", boom)

    async def one() -> BaseException:
        try:
            async for _ in async_engine.generate("r", [5, 6], GREEDY):
                pass
        except BaseException as e:  # noqa: BLE001 - the error is the result
            return e
        raise AssertionError("the request did not fail")

    err = asyncio.run(one())
    assert "injected forward failure" in str(err)
    wait_until(lambda: fatal, 10, interval=0.01, strict=False)
    assert len(fatal) == 1 and isinstance(fatal[0], EngineDeadError)
    assert not async_engine.running
    async_engine.shutdown()
    async_engine.engine.close()


def test_clients_cannot_collide_on_request_ids(llm, tiny_llama) -> None:
    """Issue 17 item 9: two in-flight requests with the same client id both run (internal ids differ)."""
    from keepwarm.worker.async_engine import AsyncEngine
    from keepwarm.worker.engine import EngineConfig, LLMEngine

    async_engine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama, dtype="float32",
                                                              max_model_len=64, daemon=False)))
    expected = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)[0].outputs[0].token_ids

    async def run() -> list:
        async def one():
            last = None
            async for out in async_engine.generate("same-id", [5, 6, 7], GREEDY):
                last = out
            return last

        return await asyncio.gather(one(), one())

    outs = asyncio.run(run())
    async_engine.shutdown()
    async_engine.engine.close()
    assert [o.request_id for o in outs] == ["same-id", "same-id"]
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected]


# -- chat templates --------------------------------------------------------------------------------------------
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    # no calls inside the loops: only the line tracer can stop it
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set x = range(100000) %}{% for a in x %}{% for b in x %}{{ '' }}{% endfor %}{% endfor %}",
])
def test_a_looping_template_stops_at_its_deadline(tiny_llama, template) -> None:
    tok = FastTokenizer(tiny_llama)
    tok.render_timeout = 0.3
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match="did not finish within 0.3s"):
        tok.apply_chat_template(MSGS, chat_template=template, tokenize=False)
    assert time.monotonic() - t0 < 30  # it stopped (the loops alone would run for hours)


@pytest.mark.parametrize("template", [
    "{{ 'x' * 1000000000 }}",
    "{{ [1] * 1000000000 }}",
    "{{ 10 ** 1000000000 }}",
    "{{ '%1000000000s' % 'x' }}",
    "{{ 'x' | center(1000000000) }}",
    "{{ 'x'.center(1000000000) }}",
    "{% set s = 'x' * 1000000 %}{{ s | replace('x', s) }}",
    "{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}",
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
])
def test_a_template_cannot_allocate_without_bound(tiny_llama, template) -> None:
    with pytest.raises(TemplateLimitError):
        FastTokenizer(tiny_llama).apply_chat_template(MSGS, chat_template=template, tokenize=False)


def test_template_sandbox_and_cache_bound(tiny_llama) -> None:
    tok = FastTokenizer(tiny_llama)
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        tok.apply_chat_template(MSGS, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                tokenize=False)
    for i in range(3 * TEMPLATE_CACHE_SIZE):
        assert tok.apply_chat_template(MSGS, chat_template=f"{i}{{{{ messages[0].content }}}}",
                                       tokenize=False) == f"{i}hi"
    assert len(tok._compiled) == TEMPLATE_CACHE_SIZE


# -- oneDNN packing and thread counts (issue 17 item 11) ------------------------------------------------------
THREADS = [1, 2, 8, 16]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _packing():
    from keepwarm.kernels import cpu_packed

    if not cpu_packed.packing_available(torch.bfloat16):
        pytest.skip("bfloat16 weight packing unavailable here (needs mkldnn bf16 and libtorch's AOTI C shim)")
    return cpu_packed


def test_packed_layout_does_not_depend_on_the_thread_count(restore_threads) -> None:
    """[576, 576] and [960, 576] bf16 pack in another blocked format at 16 threads than at 1-8 unless packing
    pins its thread count; the arena is planned from the layout, so a daemon at 16 threads failed to preload."""
    cp = _packing()
    shapes = [(576, 576), (960, 576), (576, 1536)]
    seen = {}
    for n in THREADS:
        torch.set_num_threads(n)
        for shape in shapes:
            w = torch.randn(*shape, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
            raw, desc = cp.pack(w)
            seen.setdefault(shape, set()).add(desc)
            assert raw.numel() == cp.packed_nbytes(shape, torch.bfloat16)
        assert torch.get_num_threads() == n  # packing restores the caller's count
    assert all(len(d) == 1 for d in seen.values()), {s: len(d) for s, d in seen.items()}


@pytest.mark.parametrize("run_threads", THREADS)
def test_a_weight_packed_elsewhere_computes_exactly(restore_threads, run_threads: int) -> None:
    """A worker whose thread count differs from the daemon's computes with the daemon's packed weight exactly what
    F.linear computes in the worker. (At 16 threads on an AMX CPU both split the reduction of 32 rows, so the
    bits follow the worker's count, as F.linear's do; the daemon's count does not enter.)"""
    cp = _packing()
    from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta

    w = torch.randn(576, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    torch.set_num_threads(16)  # the daemon's count
    raw, desc = cp.pack(w)
    pw = cp.PackedWeight(QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (576, 576), desc.hex()), raw, torch.bfloat16)
    torch.set_num_threads(run_threads)
    for rows in (1, 7, 32, 100):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        assert torch.equal(cp.linear_none(x, pw), F.linear(x, w)), rows


# -- logprob offsets (issue 17 item 8) ---------------------------------------------------------------------------
def test_text_offsets_index_the_returned_text_with_special_tokens_hidden(tiny_llama) -> None:
    from keepwarm.worker.http.routes.completions import text_offsets

    tok = FastTokenizer(tiny_llama)
    assert tok.eos_token_id is not None
    ids = tok.encode("Hello world", add_special_tokens=False) + [tok.eos_token_id] + \
        tok.encode(" again and again", add_special_tokens=False)
    for skip in (True, False):
        text = tok.decode(ids, skip_special_tokens=skip)
        offsets = text_offsets(tok, ids, 0, len(ids), skip, len(text))
        pieces = [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)], strict=True)]
        assert "".join(pieces) == text
        assert pieces == [tok.decode(ids[:i + 1], skip_special_tokens=skip)[len(tok.decode(
            ids[:i], skip_special_tokens=skip)):] for i in range(len(ids))]
        eos_at = ids.index(tok.eos_token_id)
        assert (pieces[eos_at] == "") == skip  # a hidden special token takes no room in the text
    # A stop string cut the text: offsets never point past its end.
    assert max(text_offsets(tok, ids, 0, len(ids), True, 3)) == 3


# -- connection limits, admission, prompt characters (worker/http/limits.py) -------------------------------------
def _asgi_run(middleware, messages: list, headers: dict[str, str] | None = None,
              send_blocks: bool = False) -> list[dict]:
    """Drive an ASGI middleware with scripted client messages ("stall": nothing more comes); returns what it sent."""
    sent: list[dict] = []

    async def main() -> None:
        incoming = list(messages)

        async def receive():
            if incoming:
                item = incoming.pop(0)
                if item == "stall":
                    await asyncio.sleep(3600)
                return item
            await asyncio.sleep(3600)

        async def send(message):
            if send_blocks and message["type"] == "http.response.body":
                await asyncio.sleep(3600)
            sent.append(message)

        await middleware({"type": "http", "method": "POST", "path": "/v1/completions",
                          "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}, receive, send)

    asyncio.run(asyncio.wait_for(main(), 30))
    return sent


def _echo_app(seen: list[str]):
    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            seen.append(m["type"])
            if m["type"] == "http.disconnect":
                break
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})
    return app


def test_body_limit_from_content_length_reads_nothing() -> None:
    from keepwarm.worker.http.limits import ConnectionLimits

    seen: list[str] = []
    mw = ConnectionLimits(_echo_app(seen), max_body_bytes=1000, timeout=5)
    sent = _asgi_run(mw, [], headers={"content-length": str(50 << 20)})
    assert sent[0]["status"] == 413 and seen == []
    assert b"--max-request-body-mb" in sent[1]["body"]


def test_body_limit_while_streaming_answers_once() -> None:
    from keepwarm.worker.http.limits import ConnectionLimits

    seen: list[str] = []
    mw = ConnectionLimits(_echo_app(seen), max_body_bytes=1000, timeout=5)
    chunk = {"type": "http.request", "body": b"x" * 600, "more_body": True}
    sent = _asgi_run(mw, [chunk, chunk, chunk])
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [413]
    assert seen == ["http.request", "http.disconnect"]  # the app learns the client is gone; its answer is dropped


def test_a_stalled_client_gets_408_and_a_stalled_reader_is_dropped() -> None:
    from keepwarm.worker.http.limits import ConnectionLimits

    seen: list[str] = []
    mw = ConnectionLimits(_echo_app(seen), max_body_bytes=1000, timeout=0.2)
    sent = _asgi_run(mw, [{"type": "http.request", "body": b"x", "more_body": True}, "stall"])
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [408]
    sent = _asgi_run(mw, [{"type": "http.request", "body": b"x"}], send_blocks=True)
    assert [m["type"] for m in sent] == ["http.response.start"]  # the body never got out; no hang


def test_admission_refuses_past_the_queue_bound() -> None:
    from keepwarm.worker.http.limits import Admission
    from keepwarm.worker.openai.protocol import APIError

    adm = Admission(max_running=2, max_queued=1)
    held = [adm.enter() for _ in range(3)]
    with pytest.raises(APIError) as info:
        adm.enter()
    assert info.value.status == 429 and "--max-queued-requests" in info.value.message
    held.pop().release()
    held.append(adm.enter())
    assert adm.active == 3 and adm.refused == 1


def test_admission_counts_a_requests_sequences() -> None:
    """A request holds one seat per sequence once its size is known; a resize past the capacity is a 429 that
    leaves its hold as it was, and its release gives every seat back."""
    from keepwarm.worker.http.limits import Admission
    from keepwarm.worker.openai.protocol import APIError

    adm = Admission(max_running=2, max_queued=2)
    big, small = adm.enter(), adm.enter()
    big.resize(3)
    assert adm.active == 4
    with pytest.raises(APIError, match="needs 1 more") as info:
        small.resize(2)
    assert info.value.status == 429 and small.held == 1 and adm.active == 4
    big.release()
    assert adm.active == 1 and big.held == 0
    small.resize(4)
    with pytest.raises(APIError):
        adm.enter()
    small.release()
    assert adm.active == 0 and adm.refused == 2


def test_prompt_characters_that_cannot_fit_are_refused_before_tokenizing(tiny_llama) -> None:
    from keepwarm.worker.http.limits import check_prompt_chars, longest_token_chars
    from keepwarm.worker.openai.protocol import APIError

    tok = FastTokenizer(tiny_llama)
    chars = longest_token_chars(tok)
    assert chars >= max(len(tok.decode([i])) for i in range(tok.vocab_size))
    check_prompt_chars(64 * chars * 4, 64, chars, "prompt")  # could still fit: tokenize it
    with pytest.raises(APIError, match="cannot fit") as info:
        check_prompt_chars(64 * chars * 4 + 1, 64, chars, "prompt")
    assert info.value.status == 400 and info.value.param == "prompt"
