"""The request fields that ask for structured output, read into one StructuredOutputs (or None).

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``strict``), vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and its newer ``structured_outputs``
object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``). At most one constraint per request: two
are a 400 naming the second. The schema is enforced whether or not ``strict`` is set (as vLLM does).
"""

from __future__ import annotations

from typing import Any

from keepwarm.worker.openai.protocol import bad_request
from keepwarm.worker.structured import StructuredOutputs

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}


def _response_format(rf: dict[str, Any]) -> StructuredOutputs | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object", None, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_request("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                              "{...}}}", "response_format")
        return StructuredOutputs("json", js.get("schema", {"type": "object"}), "response_format")
    raise bad_request(f"response_format type {kind!r} is not supported (text, json_object or json_schema)",
                      "response_format")


def _structured_outputs(so: dict[str, Any]) -> StructuredOutputs | None:
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unsupported = sorted(set(given) - set(STRUCTURED_KEYS) - {"disable_any_whitespace", "disable_fallback",
                                                                "disable_additional_properties",
                                                                "whitespace_pattern"})
    if unsupported:
        raise bad_request(f"structured_outputs.{unsupported[0]} is not supported (json, regex, choice, grammar, "
                          "json_object)", "structured_outputs")
    kinds = [k for k in STRUCTURED_KEYS if k in given]
    if len(kinds) > 1:
        raise bad_request(f"structured_outputs takes one of json, regex, choice, grammar, json_object; got "
                          f"{', '.join(kinds)}", "structured_outputs")
    if not kinds:
        return None
    return StructuredOutputs(STRUCTURED_KEYS[kinds[0]], given[kinds[0]], "structured_outputs")


def structured_spec(req: Any) -> StructuredOutputs | None:
    """The one constraint a completions or chat request asks for, if any."""
    found: list[StructuredOutputs] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(spec)
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append(StructuredOutputs(kind, value, name))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        spec = _structured_outputs(so)
        if spec is not None:
            found.append(spec)
    if len(found) > 1:
        raise bad_request(f"ask for one structured output at a time: {found[0].field} and {found[1].field} are "
                          "both set", found[1].field)
    return found[0] if found else None
