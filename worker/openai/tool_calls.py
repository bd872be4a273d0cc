"""Tool calling for chat: tool_choice -> a grammar, model output -> OpenAI ``tool_calls``, and streaming deltas.

Rules (vLLM's behaviour, OpenAI's shapes; the output shapes and parser formats: docs/vllm-compat.md, "Tool calling"):
- ``tool_choice: "none"``: tools still reach the chat template; the output is plain content.
- ``"auto"``: needs ``--enable-auto-tool-choice`` and a ``--tool-call-parser`` (``hermes``, ``llama3_json``,
  ``mistral``; else a 400 naming both); the model writes free text and the parser finds the calls in it. Output a
  parser cannot read (malformed JSON, an unknown function) stays content: a 200, never an error.
- ``"required"`` and a named function: enforced by constrained decoding whatever the model, so the arguments are valid
  JSON matching the function's ``parameters`` (required: one call or more, one if ``parallel_tool_calls`` is false);
  output cut short by ``max_tokens`` is returned as content (finish ``length``), never as a half call.
- Streaming: content streams as it comes, except text that may be the start of a tool-call marker, which is held
  back until it is told apart; each call is sent once complete, as one delta with its index, id, type, name and
  the whole arguments string (clients concatenate argument pieces, so one piece is a valid stream).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from keepwarm.worker.openai.protocol import bad_request
from keepwarm.worker.structured import StructuredOutputs

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[ToolCall]


# -- request side ----------------------------------------------------------------------------------------------
def functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> function definition; a 400 naming ``tools`` for anything but well-formed function tools."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[name] = {**fn, "parameters": params}
    return out


@dataclass(frozen=True)
class ToolMode:
    """How a chat request treats tools: ``kind`` is none | auto | required | named."""

    kind: str
    name: str = ""  # the function, for named
    parser: str = ""  # the --tool-call-parser, for auto


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str | None,
              auto_enabled: bool) -> ToolMode:
    fns = functions(tools)
    if tool_choice is None:
        tool_choice = "auto" if fns else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice")
        if name not in fns:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolMode("named", name)
    if tool_choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}",
                          "tool_choice")
    if tool_choice != "none" and not fns:
        raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              "set", "tool_choice")
        return ToolMode("auto", parser=parser)
    return ToolMode(tool_choice)


def tool_grammar(mode: ToolMode, tools: list[dict[str, Any]] | None,
                 parallel: bool | None = None) -> StructuredOutputs | None:
    """The constraint that enforces a required or named choice (None for none / auto); ``parallel`` False
    (``parallel_tool_calls: false``) allows one call."""
    fns = functions(tools)
    if mode.kind == "named":
        return StructuredOutputs("json", fns[mode.name]["parameters"], field="tool_choice")
    if mode.kind != "required":
        return None
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                 "properties": {"name": {"const": name}, "parameters": fn["parameters"]}}
                for name, fn in fns.items()]
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    array = {"type": "array", "minItems": 1, "items": item}
    if parallel is False:
        array["maxItems"] = 1
    return StructuredOutputs("json", array, field="tool_choice")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` with their arguments as objects, as Hugging Face chat templates expect them
    (``tool_call.arguments | tojson``); arguments that are not JSON stay text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(json.JSONDecodeError):
                        fn["arguments"] = json.loads(fn["arguments"])
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# -- output side -----------------------------------------------------------------------------------------------
def _call(obj: Any, known: set[str], args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in known:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values in ``text`` (separated by whitespace, ``;`` or ``,``), or None if any is malformed."""
    dec, pos = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return out
        try:
            value, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        out.append(value)


HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_hermes(text: str, known: set[str]) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text, [])
    calls = []
    for body in HERMES.findall(text[start:]):
        values = _json_values(body.strip())
        if not values or len(values) != 1 or (call := _call(values[0], known)) is None:
            return Parsed(text, [])
        calls.append(call)
    content = text[:start].strip()
    return Parsed(content or None, calls)


def parse_llama3_json(text: str, known: set[str]) -> Parsed:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    if not body.startswith("{"):
        return Parsed(text, [])
    values = _json_values(body)
    calls = [_call(v, known, "parameters") for v in values or []]
    if not calls or any(c is None for c in calls):
        return Parsed(text, [])
    return Parsed(None, calls)  # type: ignore[arg-type]


MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")


def parse_mistral(text: str, known: set[str]) -> Parsed:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return Parsed(text, [])
    content = text[:start].strip() or None
    body = text[start + len("[TOOL_CALLS]"):].strip()
    calls: list[ToolCall | None] = []
    if body.startswith("["):
        values = _json_values(body)
        if not values or not isinstance(values[0], list):
            return Parsed(text, [])
        calls = [_call(v, known) for v in values[0]]
    else:  # v11: name[ARGS]{json}, repeated after further [TOOL_CALLS] markers
        for part in body.split("[TOOL_CALLS]"):
            m = MISTRAL_V11.match(part.strip())
            values = _json_values(part.strip()[m.end():]) if m else None
            calls.append(_call({"name": m.group(1), "arguments": values[0]}, known)
                         if m and values and len(values) == 1 else None)
    if not calls or any(c is None for c in calls):
        return Parsed(text, [])
    return Parsed(content, calls)  # type: ignore[arg-type]


_PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
# The text that opens a tool call in each format (streaming holds back a possible prefix of it).
MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",)}


def parse(parser: str, text: str, known: set[str]) -> Parsed:
    return _PARSE[parser](text, known)


def parse_forced(mode: ToolMode, text: str) -> Parsed:
    """The output of a grammar-enforced choice (required / named) as calls; content if it was cut short."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:  # max_tokens ended it early: return what there is, as content
        return Parsed(text, [])
    if mode.kind == "named":
        return Parsed(None, [ToolCall(mode.name, json.dumps(value, ensure_ascii=False))])
    return Parsed(None, [ToolCall(v["name"], json.dumps(v["parameters"], ensure_ascii=False)) for v in value])


def parse_output(mode: ToolMode, text: str, known: set[str]) -> Parsed:
    """A finished choice's text as content and/or calls, by the request's tool mode."""
    if mode.kind == "none":
        return Parsed(text, [])
    if mode.kind in ("required", "named"):
        return parse_forced(mode, text)
    return parse(mode.parser, text, known)


class ToolStreamer:
    """Turns the growing output text of one choice into chat-chunk deltas (``content`` and ``tool_calls``)."""

    def __init__(self, mode: ToolMode, known: set[str]) -> None:
        self.mode = mode
        self.known = known
        self.sent = 0  # characters of content already sent
        self.calls_sent = 0
        self.in_calls = False  # a whole marker was seen: the rest is held back

    def _marker_at(self, text: str) -> int | None:
        """Where a tool call starts (or may start: a marker's prefix at the end), if anywhere."""
        markers = MARKERS[self.mode.parser]
        if self.mode.parser == "llama3_json":  # only at the very start of the output
            stripped = text.lstrip()
            if not stripped:
                return 0
            if any(stripped.startswith(m) or m.startswith(stripped) for m in markers):
                return len(text) - len(stripped)
            return None
        best = None
        for m in markers:
            i = text.find(m)
            if i >= 0:
                best = i if best is None else min(best, i)
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    j = len(text) - k
                    best = j if best is None else min(best, j)
                    break
        return best

    def step(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas for the text so far (call with the whole text each time)."""
        if self.mode.kind == "none":
            return self._content(text, len(text))
        if self.mode.kind in ("required", "named"):
            return self._final(parse_forced(self.mode, text), text, 0) if finished else []
        start = self._marker_at(text)
        if start is None and not self.in_calls:
            return self._content(text, len(text))
        if finished:
            return self._final(parse(self.mode.parser, text, self.known), text, start or 0)
        # A whole marker seen (not just a possible prefix of one): the rest is held back until the end.
        if start is not None and text[start:].startswith(MARKERS[self.mode.parser]):
            self.in_calls = True
        return self._content(text, start) if start is not None else []

    def _content(self, text: str, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        piece, self.sent = text[self.sent:end], end
        return [{"content": piece}]

    def _final(self, parsed: Parsed, text: str, marker: int) -> list[dict[str, Any]]:
        if not parsed.calls:  # not a tool call after all: the rest is content
            return self._content(text, len(text))
        deltas = self._content(text, marker) if text[:marker].strip() else []
        for call in parsed.calls:
            deltas.append({"tool_calls": [call.to_openai(self.calls_sent)]})
            self.calls_sent += 1
        return deltas
