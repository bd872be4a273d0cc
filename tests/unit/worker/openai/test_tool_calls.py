"""Tool-call parsers (hermes, llama3_json, mistral), malformed output kept as content, tool_choice rules, and the
streaming deltas reassembled."""

from __future__ import annotations

import json

import pytest

from keepwarm.worker.openai.protocol import APIError
from keepwarm.worker.openai.tool_calls import (
    ToolMode,
    ToolStreamer,
    parse,
    parse_forced,
    template_messages,
    tool_grammar,
    tool_mode,
)

KNOWN = {"get_weather", "add"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

GOOD = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', None),
    "mistral_v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', None),
}
MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '<tool_call>{"name": "nope", '
               '"arguments": {}}</tool_call>', "<tool_call>not json</tool_call>"],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": ', '{"city": "Paris"}', '{"name": "nope"}'],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', "[TOOL_CALLS]oops",
                '[TOOL_CALLS]add[ARGS]{"a": '],
}


@pytest.mark.parametrize("case", list(GOOD))
def test_parsers_read_their_format(case: str) -> None:
    parser = case.removesuffix("_v11")
    text, content = GOOD[case]
    parsed = parse(parser, text, KNOWN)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in parsed.calls}) == 2


@pytest.mark.parametrize("parser", list(MALFORMED))
def test_malformed_output_stays_content(parser: str) -> None:
    for text in MALFORMED[parser] + ["Just an answer, no call."]:
        parsed = parse(parser, text, KNOWN)
        assert parsed.calls == [] and parsed.content == text


def test_tool_choice_rules() -> None:
    assert tool_mode(TOOLS, "required", None, False).kind == "required"
    assert tool_mode(TOOLS, {"type": "function", "function": {"name": "add"}}, None, False) == ToolMode("named",
                                                                                                         "add")
    assert tool_mode(None, None, None, False).kind == "none"
    assert tool_mode(TOOLS, "auto", "hermes", True) == ToolMode("auto", parser="hermes")
    for bad, word in [((TOOLS, "auto", None, False), "enable-auto-tool-choice"),
                      ((TOOLS, {"type": "function", "function": {"name": "zzz"}}, None, False), "zzz"),
                      ((None, "required", None, False), "needs tools"),
                      ((TOOLS, "sometimes", None, False), "tool_choice"),
                      (([{"type": "function", "function": {}}], "required", None, False), "name")]:
        with pytest.raises(APIError, match=word) as e:
            tool_mode(*bad)
        assert e.value.status == 400
    assert tool_grammar(ToolMode("named", "add"), TOOLS).value == TOOLS[1]["function"]["parameters"]
    required = tool_grammar(ToolMode("required"), TOOLS).value
    assert required["minItems"] == 1 and len(required["items"]["anyOf"]) == 2 and "maxItems" not in required
    assert tool_grammar(ToolMode("required"), TOOLS, parallel=False).value["maxItems"] == 1


def test_forced_outputs_become_calls() -> None:
    p = parse_forced(ToolMode("required"), '[{"name": "add", "parameters": {"a": 1, "b": 2}}]')
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("add", {"a": 1, "b": 2})]
    p = parse_forced(ToolMode("named", "get_weather"), '{"city": "Oslo"}')
    assert p.content is None and json.loads(p.calls[0].arguments) == {"city": "Oslo"}
    cut = parse_forced(ToolMode("named", "get_weather"), '{"city": "Os')  # max_tokens hit
    assert cut.calls == [] and cut.content == '{"city": "Os'


def test_history_arguments_become_objects_for_templates() -> None:
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request is not modified
    assert out[1] == msgs[1]


def reassemble(mode: ToolMode, text: str, cut_every: int = 3) -> tuple[str, list[dict]]:
    """Feed the text in pieces as the engine would and rebuild the message as an OpenAI client does."""
    streamer = ToolStreamer(mode, KNOWN)
    content, calls = "", {}
    for end in [*range(cut_every, len(text), cut_every), len(text)]:
        for d in streamer.step(text[:end], end == len(text)):
            content += d.get("content", "")
            for tc in d.get("tool_calls", []):
                slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                slot["name"] += tc["function"].get("name", "")
                slot["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("case", list(GOOD))
def test_streaming_deltas_reassemble(case: str) -> None:
    parser = case.removesuffix("_v11")
    text, content = GOOD[case]
    got_content, calls = reassemble(ToolMode("auto", parser=parser), text)
    assert got_content.strip() == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("parser", list(MALFORMED))
def test_streaming_malformed_and_plain_text_arrive_whole(parser: str) -> None:
    for text in MALFORMED[parser] + ["Plain answer with a < sign and [brackets] {braces}."]:
        content, calls = reassemble(ToolMode("auto", parser=parser), text)
        assert calls == [] and content == text


def test_streaming_plain_text_is_not_held_back() -> None:
    s = ToolStreamer(ToolMode("auto", parser="hermes"), KNOWN)
    assert s.step("Hello wor", False) == [{"content": "Hello wor"}]
    assert s.step("Hello world <tool", False) == [{"content": "ld "}]  # "<tool" may open a call: held
    assert s.step("Hello world <tooling", False) == [{"content": "<tooling"}]
