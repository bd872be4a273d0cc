"""Issue 43 rows 8-11 and 13: request limits checked before the expensive work, against a real server.

Every refused row asserts a 400 in OpenAI's shape whose ``param`` names the field, a one-line message that names it
too and quotes no Rust panic or backtrace, an answer within a generous time, and that an ordinary request sent
meanwhile (from another thread) is served. Row 8 also bounds the server's peak memory (VmHWM, reset before each
request where the kernel allows). One server serves every row; the unit tests at the end check the limit
functions themselves (fast, no server).
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from support.serve import ServeProcess

from keepwarm.worker.sampler import seeded_generator
from keepwarm.worker.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)
from keepwarm.worker.structured import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GBNF_RULES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    GrammarError,
    StructuredOutputs,
    one_line,
    unending_ref,
)
from keepwarm.worker.tokenizer import MAX_TEMPLATE_CHARS, FastTokenizer, TemplateLimitError

ANSWER_S = 10.0  # generous: every refusal below comes in well under a second on a quiet machine
MEMORY_MIB = 256  # row 8: peak growth allowed per request (before: +1.5 GiB for 30 doublings)
CHAT = [{"role": "user", "content": "hi"}]


class LimitsServer(ServeProcess):
    def __init__(self, model: str) -> None:
        super().__init__(model, "--no-daemon", "--dtype", "float32", "--max-model-len", "512", "--threads", "1",
                         "--served-model-name", "tiny", "--trust-request-chat-template")
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)

    def status(self, key: str) -> int:
        """A /proc/<pid>/status figure in MiB (VmHWM: the peak resident set)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) >> 10
        raise KeyError(key)

    def reset_peak(self) -> None:
        # "5" resets VmHWM to the current RSS (Linux 4.0+); without it the growth bound only gets weaker.
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = LimitsServer(tiny_llama)
    yield s
    assert s.stop() == 0, s.output()[-3000:]


def alongside(server: LimitsServer, hostile: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``hostile`` (its result or the exception it raised) in a thread while an ordinary request is served."""
    box: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            box["result"] = hostile()
        except Exception as e:  # the refusal is the result under test
            box["result"] = e
        box["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    ordinary = server.client.completions.create(model="tiny", prompt="ok", max_tokens=2)
    thread.join(120)
    assert not thread.is_alive()
    assert ordinary.usage.completion_tokens >= 1
    return box["result"], box["seconds"]


def refused(result: Any, seconds: float, param: str) -> str:
    assert isinstance(result, openai.BadRequestError), result
    assert result.status_code == 400
    body = result.body if isinstance(result.body, dict) else {}
    err = body.get("error", body)
    message = err["message"]
    assert err["param"] == param, err
    assert "\n" not in message and len(message) < 600, message
    assert param in message or param.replace("_", " ") in message, message
    assert "panic" not in message.lower() and "backtrace" not in message.lower(), message
    assert seconds < ANSWER_S, seconds
    return message


def chat(server: LimitsServer, **extra: Any) -> Callable[[], Any]:
    return lambda: server.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, **extra)


# -- row 8: a request's chat template cannot grow a string past MAX_TEMPLATE_CHARS -------------------------------
def doubling(expr: str, times: int = 30) -> str:
    return ("{% set ns = namespace(s='x') %}{% for i in range(" + str(times) + ") %}{% set ns.s = " + expr +
            " %}{% endfor %}{{ ns.s | length }}")


DOUBLINGS = {
    "~ x29": doubling("ns.s ~ ns.s", 29),
    "~": doubling("ns.s ~ ns.s"),
    "+": doubling("ns.s + ns.s"),
    "%": doubling("'%s%s' % (ns.s, ns.s)"),
    "*": doubling("ns.s * 2"),
    "join filter": doubling("[ns.s, ns.s] | join"),
    "str.join": doubling("''.join([ns.s, ns.s])"),
    "format filter": doubling("'%s%s' | format(ns.s, ns.s)"),
    "str.format": doubling("'{0}{0}'.format(ns.s)"),
    "replace": doubling("ns.s.replace('x', 'xx')"),
    "indent": doubling("ns.s | indent(width=ns.s, first=True)"),
    "string of a list": doubling("[ns.s, ns.s] | string"),
    "tojson of a list": doubling("[ns.s, ns.s] | tojson"),
    "captured block": "{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set t %}{{ ns.s }}{{ ns.s }}"
                      "{% endset %}{% set ns.s = t %}{% endfor %}{{ ns.s | length }}",
    "macro": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s | length }}{% endif %}"
             "{% endmacro %}{{ d('x', 30) }}",
    "printed nested list": "{% set ns = namespace(l=['x' * 1000]) %}{% for i in range(30) %}"
                           "{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
}


@pytest.mark.slow
@pytest.mark.parametrize("template", DOUBLINGS.values(), ids=DOUBLINGS.keys())
def test_row8_a_template_cannot_grow_a_string_past_the_limit(server, template) -> None:
    server.reset_peak()
    before = server.status("VmHWM")
    result, seconds = alongside(server, chat(server, extra_body={"chat_template": template}))
    message = refused(result, seconds, "chat_template")
    assert f"limit {MAX_TEMPLATE_CHARS}" in message
    assert server.status("VmHWM") - before < MEMORY_MIB


@pytest.mark.slow
def test_row8_a_template_under_the_limit_still_renders(server) -> None:
    template = doubling("ns.s ~ ns.s", 20) + "{% for m in messages %}{{ m.content }}{% endfor %}"
    out = server.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                                extra_body={"chat_template": template})
    assert out.usage.prompt_tokens >= 2  # "1048576hi" was rendered and tokenized


# -- row 9: structured-output limits, before compilation; compiler errors in one clean line -----------------------
def _chain(rules: int) -> str:
    """A right-recursive Lark chain: 3000 rules overflowed llguidance's recursion on an 8 MiB stack (SIGSEGV)."""
    return "start: r0\n" + "\n".join(f'r{i}: "t" r{i + 1} | "e"' for i in range(rules)) + f'\nr{rules}: "z"\n'


def _tools(n: int) -> list[dict[str, Any]]:
    props = {f"p{j}": {"type": "string", "enum": ["a", "b", "c"]} for j in range(10)}
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": props}}}
            for i in range(n)]


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


ROW9 = {
    "guided_choice 100k": ({"extra_body": {"guided_choice": [f"option number {i}" for i in range(100_000)]}},
                           "guided_choice", str(MAX_CHOICES)),
    "guided_choice chars": ({"extra_body": {"guided_choice": ["x" * (MAX_CHOICE_CHARS // 2 + 1)] * 2}},
                            "guided_choice", str(MAX_CHOICE_CHARS)),
    "guided_regex length": ({"extra_body": {"guided_regex": "a" * (MAX_REGEX_CHARS + 1)}}, "guided_regex",
                            str(MAX_REGEX_CHARS)),
    "guided_grammar length": ({"extra_body": {"guided_grammar": _chain(MAX_GRAMMAR_CHARS // 20)}},
                              "guided_grammar", str(MAX_GRAMMAR_CHARS)),
    "GBNF rules": ({"extra_body": {"guided_grammar": "root ::= r0\n" + "\n".join(
        f'r{i} ::= "t"' for i in range(MAX_GBNF_RULES + 1))}}, "guided_grammar", str(MAX_GBNF_RULES)),
    "schema values": ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(MAX_SCHEMA_NODES)}}}}},
        "response_format", str(MAX_SCHEMA_NODES)),
    "schema depth": ({"extra_body": {"guided_json": _deep_schema(MAX_SCHEMA_DEPTH)}}, "guided_json",
                     str(MAX_SCHEMA_DEPTH)),
    "tools forced": ({"tools": _tools(300), "tool_choice": "required"}, "tool_choice", str(MAX_SCHEMA_NODES)),
    "stop strings": ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop", str(MAX_STOP_STRINGS)),
    "stop length": ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", str(MAX_STOP_STRING_CHARS)),
    "stop_token_ids": ({"extra_body": {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}}, "stop_token_ids",
                       str(MAX_STOP_TOKEN_IDS)),
    # A compiler error that was several lines (the grammar quoted under a caret) is one line now.
    "compiler error": ({"extra_body": {"guided_grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000}},
                       "guided_grammar", "nested"),
}


@pytest.mark.slow
@pytest.mark.parametrize("extra,param,says", ROW9.values(), ids=ROW9.keys())
def test_row9_structured_limits_are_checked_first(server, extra, param, says) -> None:
    result, seconds = alongside(server, chat(server, **extra))
    assert says in refused(result, seconds, param)


@pytest.mark.slow
def test_row9_a_deep_grammar_compiles_on_a_big_stack_instead_of_killing_the_server(server) -> None:
    result, seconds = alongside(server, chat(server, extra_body={"guided_grammar": _chain(3000)}))
    assert not isinstance(result, Exception), result
    assert result.choices[0].message.content[:1] in ("t", "e", "z") and seconds < ANSWER_S
    assert server.proc.poll() is None


# -- row 10: a schema whose recursion cannot end is refused; one with a way out still works ----------------------
ROW10 = {
    "$ref #": ({"$ref": "#"}, "'#'"),
    "a -> b -> a": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                    "#/$defs/"),
    "definitions": ({"definitions": {"a": {"allOf": [{"$ref": "#/definitions/a"}]}},
                     "type": "object", "properties": {"x": {"$ref": "#/definitions/a"}}}, "#/definitions/a"),
    "required self": ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
                      "#/properties/next"),
}


@pytest.mark.slow
@pytest.mark.parametrize("schema,where", ROW10.values(), ids=ROW10.keys())
@pytest.mark.parametrize("field", ["response_format", "guided_json"])
def test_row10_a_schema_whose_recursion_cannot_end_is_refused(server, schema, where, field) -> None:
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}} \
        if field == "response_format" else {"extra_body": {"guided_json": schema}}
    result, seconds = alongside(server, chat(server, **extra))
    message = refused(result, seconds, field)
    assert "recursive" in message and where in message


@pytest.mark.slow
def test_row10_recursion_with_a_way_out_gives_valid_json(server) -> None:
    schema = {"anyOf": [{"$ref": "#"}, {"type": "integer", "minimum": 0, "maximum": 9}]}
    out = server.client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "digit", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content) in range(10)


# -- row 11: background responses are refused, not run synchronously -----------------------------------------------
@pytest.mark.slow
def test_row11_background_is_refused_and_false_still_works(server) -> None:
    def background() -> Any:
        return server.client.responses.create(model="tiny", input="hi", max_output_tokens=4, background=True)

    result, seconds = alongside(server, background)
    assert "stateless" in refused(result, seconds, "background")
    done = server.client.responses.create(model="tiny", input="hi", max_output_tokens=4, background=False)
    assert done.status in ("completed", "incomplete")


# -- row 13: every bit of a seed counts ------------------------------------------------------------------------
@pytest.mark.slow
def test_row13_distinct_seeds_give_distinct_streams(server) -> None:
    def text(seed: int) -> str:
        out = server.client.completions.create(model="tiny", prompt="Hi", max_tokens=16, temperature=1.0,
                                               seed=seed, extra_body={"ignore_eos": True})
        return out.choices[0].text

    assert text(-1) != text(2**63 - 1)
    assert text(-2**63) != text(0)
    assert text(-1) == text(-1)  # and a seed still fixes its stream
    result, seconds = alongside(server, lambda: text(2**63 - 1))
    assert isinstance(result, str) and seconds < ANSWER_S


# -- unit tests of the limit functions (no server) -------------------------------------------------------------
@pytest.mark.parametrize("template", DOUBLINGS.values(), ids=DOUBLINGS.keys())
def test_each_growing_operation_stops_at_the_limit_in_process(tiny_llama, template) -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=f"limit {MAX_TEMPLATE_CHARS}"):
        FastTokenizer(tiny_llama).apply_chat_template(CHAT, chat_template=template, tokenize=False)
    assert time.monotonic() - t0 < ANSWER_S


@pytest.mark.parametrize("template", [
    "{{ ('\t' * 1000).expandtabs(4000000) }}",
    "{{ ('x' * 1000).translate({120: 'y' * 100000}) }}",
    "{{ '{:{}}{:{}}'.format('x', 4000000, 'y', 4000000) }}",
    "{{ ('x' * 4000000) | list | length }}",
    "{{ [1] | slice(4000000) | list | length }}",
    "{{ ('x' * 1000000) | wordwrap(1, wrapstring='yyyy') }}",
    "{{ ('&' * 1000000) | forceescape }}",
    "{% set ns = namespace(l=[1]) %}{% for i in range(30) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "{% set ns = namespace(l=[[1]]) %}{% for i in range(30) %}{% set ns.l = [ns.l, ns.l] | sum(start=[]) %}"
    "{% endfor %}",
    "{{ strftime_now('%c' * 1000000) }}",
])
def test_other_growing_operations_are_bounded(tiny_llama, template) -> None:
    with pytest.raises(TemplateLimitError):
        FastTokenizer(tiny_llama).apply_chat_template(CHAT, chat_template=template, tokenize=False)


def test_a_rich_template_renders_as_plain_jinja2_does(tiny_llama) -> None:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}"
        "{{ '<|' ~ m.role ~ '|>' + m.content | trim }}{% endfor %}{{ '%d chars, %5.2f' % (ns.n, 3.14159) }}\n"
        "{{ messages | map(attribute='role') | join(', ') }} {{ '{:>6}'.format('ab') }} {{ 'x' | center(9) }}|"
        "{{ 'a\nb' | indent(2, first=True) }}|{{ 'word ' * 3 }}|{{ [1, 2] + [3] }}|{{ 'abc' | replace('b', 'BB') }}"
        "|{{ tools | tojson(indent=2) }} {{ [[1], [2]] | sum(start=[]) }} {{ 'x%sy' | format(5) }} {{ 2 ** 10 }}"
        "{{ 'a-b'.split('-') | join('+') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }}")
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "What's <2> & 'two'?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    ours = FastTokenizer(tiny_llama).apply_chat_template(messages, chat_template=template, tokenize=False,
                                                         tools=tools)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    plain = env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=False,
                                             bos_token="<s>", eos_token="<|im_end|>", pad_token="",
                                             unk_token="<unk>")
    assert ours == plain


UNENDING = [
    ({"$ref": "#"}, "#"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$defs/b"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "#/properties/next"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#/items"),
    ({"anyOf": [{"$ref": "#"}, {"$ref": "#/$defs/x"}], "$defs": {"x": {"$ref": "#"}}}, "#/anyOf/1"),
    ({"$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}, "$ref": "#/$defs/a~1b"}, "#/$defs/a~1b"),
    # recursion with a way out, or none at all: accepted
    ({"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array",
                                                                                 "items": {"$ref": "#"}}},
      "required": ["name", "children"]}, None),
    ({"anyOf": [{"$ref": "#"}, {"type": "string"}]}, None),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}}, None),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "type": "string"}, None),  # a loop nothing uses
    ({"$ref": "http://example.com/schema.json"}, None),  # not local: llguidance's to refuse
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, None),  # unsatisfiable, not recursive
]


@pytest.mark.parametrize("schema,where", UNENDING)
def test_unending_ref_finds_recursion_without_a_way_out(schema, where) -> None:
    assert unending_ref(schema) == where


@pytest.mark.parametrize("spec,says", [
    (StructuredOutputs("choice", ["a"] * (MAX_CHOICES + 1), "guided_choice"), "choices"),
    (StructuredOutputs("regex", "a" * (MAX_REGEX_CHARS + 1), "guided_regex"), "characters long"),
    (StructuredOutputs("grammar", "x" * (MAX_GRAMMAR_CHARS + 1), "guided_grammar"), "characters long"),
    (StructuredOutputs("json", json.dumps(_deep_schema(MAX_SCHEMA_DEPTH)), "guided_json"), "nests deeper"),
    (StructuredOutputs("json", "[" * 100_000 + "]" * 100_000, "guided_json"), "not valid JSON"),
    (StructuredOutputs("json", {"$ref": "#"}, "response_format"), "recursive"),
])
def test_limits_are_checked_before_compiling(spec, says) -> None:
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match=says) as e:
        spec.grammar_text()
    assert e.value.field == spec.field and "\n" not in str(e.value)
    assert time.monotonic() - t0 < 1.0


def test_compiler_errors_become_one_clean_line() -> None:
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n   0: <unknown>\n"
    assert one_line(panic, "choice") == "the choice is too large or too complex to compile"
    assert one_line("1(7): bad token\n   1 | start: (((\n     |  ^", "grammar") == "1(7): bad token"
    assert one_line("x" * 1000, "regex") == "x" * 300 + "..."


def test_stop_conditions_are_bounded() -> None:
    with pytest.raises(SamplingParamsError, match="limit") as e:
        SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
    assert e.value.field == "stop" and len(str(e.value)) < 200
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    assert e.value.field == "stop" and len(str(e.value)) < 200
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    assert e.value.field == "stop_token_ids"
    assert SamplingParams(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS).stop


def _draws(seed: int) -> list[float]:
    return torch.empty(8).exponential_(generator=seeded_generator(seed)).tolist()


def test_seeded_generators_use_every_bit_of_the_seed() -> None:
    pairs = [(-1, 2**63 - 1), (-2**63, 0), (0, 2**32), (5, 5 + 2**40), (-1, 2**32 - 1)]
    for a, b in pairs:
        assert _draws(a) != _draws(b), (a, b)
    assert _draws(-7) == _draws(-7)
    # seeds in [0, 2**32) keep torch's own streams
    assert _draws(42) == torch.empty(8).exponential_(generator=torch.Generator().manual_seed(42)).tolist()
    # any other seed is a real mt19937 seeded by init_by_array: its raw words are the reference's
    for seed in (-1, 2**40 + 7):
        words = torch.empty(6, dtype=torch.int32).random_(generator=seeded_generator(seed)).tolist()
        reference = random.Random(seed & (2**64 - 1))
        assert words == [reference.getrandbits(32) & 0x7FFFFFFF for _ in range(6)]
    with pytest.raises(ValueError, match="Overflow"):  # what torch cannot take still fails loudly
        seeded_generator(1 << 64)
