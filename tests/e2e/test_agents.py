"""What agents and tools send, end to end against real `keepwarm serve` processes: langchain-openai's structured
output and tools, the openai client's parse / named tool_choice / streamed tool calls / Responses API, lenient
unknown fields, /tokenize, /detokenize and /ping.

Two servers: SmolLM2 (whose template knows no tools: the grammar alone makes the calls valid) and a tiny random
Qwen2 whose template takes tools (Hermes format). Whatever the model, forced calls and schemas must validate.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from support.serve import ServeProcess

pytestmark = pytest.mark.slow


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name", max_length=20)
    age: int = Field(description="age in years")


class Loose(BaseModel):
    """Anything JSON-object shaped (json_mode promises an object, not a schema)."""

    model_config = {"extra": "allow"}


class GetWeather(BaseModel):
    """Get the weather for a city."""

    city: str = Field(max_length=20)
    unit: str = Field(description="celsius or fahrenheit", pattern="^(celsius|fahrenheit)$")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}


def check_weather_args(args: dict) -> None:
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and 1 <= args["days"] <= 7


@pytest.fixture(scope="module", params=["smollm2", "tiny_tools"])
def server(request, tiny_model_factory):
    if request.param == "smollm2":
        from keepwarm.worker.default_model import default_model

        model, name = str(default_model()), "smollm2"
        extra = ("--max-model-len", "1024")
    else:
        model, name = tiny_model_factory("qwen2_tools"), "tiny-tools"
        extra = ("--dtype", "float32", "--max-model-len", "1024")
    s = ServeProcess(model, "--no-daemon", "--served-model-name", name, "--threads", "1",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *extra)
    s.name = name
    yield s
    assert s.stop() == 0


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=server.name, base_url=server.base + "/v1", api_key="none", temperature=0,
                      max_tokens=120, max_retries=0)


# -- langchain-openai --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(server, method: str) -> None:
    llm = chat_model(server).with_structured_output(Person, method=method)
    person = llm.invoke("Invent a person: a name and an age.")
    assert isinstance(person, Person)
    batch = llm.batch(["Describe a famous scientist.", "Describe a child."])
    assert all(isinstance(p, Person) for p in batch)


def test_langchain_json_mode(server) -> None:
    llm = chat_model(server).with_structured_output(Loose, method="json_mode", include_raw=True)
    out = llm.invoke("Reply in JSON: an object with a name and an age.")
    assert out["parsing_error"] is None
    assert isinstance(json.loads(out["raw"].content), dict)


def test_langchain_bind_tools_required(server) -> None:
    # One call: a random model would otherwise list calls until max_tokens (then it gets content, not calls).
    llm = chat_model(server).bind_tools([GetWeather, TIME_TOOL], tool_choice="required", parallel_tool_calls=False)
    msg = llm.invoke("What's the weather in Oslo?")
    assert len(msg.tool_calls) == 1, msg
    for call in msg.tool_calls:
        if call["name"] == "GetWeather":
            GetWeather(**call["args"])
        else:
            assert call["name"] == "get_time" and call["args"]["zone"] in ("UTC", "CET", "PST")


# -- the openai client -------------------------------------------------------------------------------------------
def test_openai_parse(server) -> None:
    done = client(server).chat.completions.parse(
        model=server.name, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
        max_tokens=120, temperature=0)
    assert isinstance(done.choices[0].message.parsed, Person)


def test_named_tool_choice_and_history(server) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "Weather in Paris for three days?"}]
    r = c.chat.completions.create(model=server.name, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                  max_tokens=60, temperature=0.7, seed=1)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    check_weather_args(json.loads(call.function.arguments))
    # The call and its result go back into the history (tool_calls and tool_call_id reach the template).
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = c.chat.completions.create(model=server.name, messages=messages, tools=[WEATHER_TOOL], max_tokens=8,
                                      tool_choice="none")
    assert again.choices[0].message.content is not None and not again.choices[0].message.tool_calls
    tok = httpx.post(server.base + "/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]}).json()
    text = httpx.post(server.base + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    if server.name == "tiny-tools":  # its template shows tools, the call and the tool's answer
        assert '"name": "get_weather"' in text and "<tool_response>\nsunny, 21 C" in text and "<tools>" in text


def test_streamed_tool_calls_reassemble(server) -> None:
    stream = client(server).chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "Weather in Rome and the time in CET?"}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=150,
        temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    calls: dict[int, dict] = {}
    finish, usages = None, []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage.completion_tokens)
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                slot["id"] = slot["id"] or tc.id
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    slot = calls[0]
    assert slot["id"] and slot["name"] in ("get_weather", "get_time")
    args = json.loads(slot["arguments"])
    if slot["name"] == "get_weather":
        check_weather_args(args)
    else:
        assert args["zone"] in ("UTC", "CET", "PST")
    assert len(usages) > 2 and usages == sorted(usages)  # continuous usage: on every chunk, growing


def test_responses_api(server) -> None:
    c = client(server)
    r = c.responses.create(model=server.name, input="Say hello.", max_output_tokens=8, store=True)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 8
    r = c.responses.create(model=server.name, input="Weather in Lima for 2 days?",
                           tools=[{"type": "function", **WEATHER_TOOL["function"]}], tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=150, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    check_weather_args(json.loads(calls[0].arguments))
    events = list(c.responses.create(model=server.name, input="Count to three.", max_output_tokens=10,
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


# -- lenient fields, tokenizer endpoints, ping, errors -------------------------------------------------------------
def test_unknown_fields_are_accepted_and_logged_once(server) -> None:
    body = {"model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "frobnicate_xyz": 1}
    for _ in range(2):
        r = httpx.post(server.base + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    assert server.output().count("'frobnicate_xyz'") == 1


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"guided_regex": "([a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER_TOOL], "tool_choice": "required"},
     "response_format"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_constraints_are_400s(server, body: dict, param: str) -> None:
    r = httpx.post(server.base + "/v1/chat/completions",
                   json={"model": server.name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                         **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_detokenize_ping(server) -> None:
    r = httpx.post(server.base + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] > 0
    assert httpx.post(server.base + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "hello world"
    assert httpx.post(server.base + "/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
    assert httpx.get(server.base + "/ping").status_code == 200
    assert httpx.post(server.base + "/ping").status_code == 200


def test_guided_fields_on_completions(server) -> None:
    r = httpx.post(server.base + "/v1/completions", json={
        "model": server.name, "prompt": "The answer is", "max_tokens": 10, "guided_choice": ["yes", "no"]}).json()
    assert r["choices"][0]["text"] in ("yes", "no")
    r = httpx.post(server.base + "/v1/completions", json={
        "model": server.name, "prompt": "A date:", "max_tokens": 20,
        "structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}}).json()
    import re

    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r["choices"][0]["text"])
