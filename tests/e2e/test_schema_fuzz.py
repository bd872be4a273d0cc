"""schemathesis against a running `keepwarm serve`, over the server's own /openapi.json (issue 17, item 10).

The server must never answer 5xx to what a client sends, must answer only the statuses and content types its
schema documents, and its JSON bodies must match the documented response schemas; a 405 carries ``Allow`` with
the path's methods (``unsupported_method``, ``allow_header_conformance``). And the schema says what the server
accepts (issue 43): no request valid by the published schema is refused (schemathesis's
``positive_data_acceptance``, read from its NDJSON report so every case counts, not the first per operation),
but for the rules no JSON Schema can state, each listed in NO_SCHEMA_STATES with why. schemathesis runs as its
CLI from a temporary directory (never the repository root: its folders shadow installed packages), with a fixed
seed and a bounded number of examples per operation, against a small --max-model-len so each case is quick. The
two runs (without and with an API key) go at once, each against a server of its own.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support.serve import ServeProcess

pytestmark = pytest.mark.slow

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "unsupported_method,allow_header_conformance")
MAX_EXAMPLES = 20
API_KEY = "fuzz-key"
# The refusals of schema-valid requests that no schema can prevent: each rule compares what JSON Schema cannot.
NO_SCHEMA_STATES = {
    "maximum context length": "the prompt's length in tokens (and max_tokens beside it) against the context",
    "min_tokens must be between 0 and max_tokens": "one field's value against another's",
    "which is not among the tools": "a value that must be one of another field's values",
    "seed must be an integer in": "seed + n - 1 within int64: a sum of two fields",
    r"^invalid (json|regex|grammar)|JSON schema|a grammar must": "what a grammar, regex or JSON Schema string means",
    "cannot apply the chat template": "what the model's chat template accepts (roles, their order)",
}
# What positive_data_acceptance takes as accepted besides 2xx (schemathesis's default).
ACCEPTED = (401, 403, 404, 409, 429)


def valid_but_refused(report_dir: Path) -> list[str]:
    """Every schema-valid (positive) case the server refused with a 4xx meaning "invalid" ("METHOD path: message"),
    from schemathesis's NDJSON report, but for the NO_SCHEMA_STATES rules."""
    refused = set()
    for path in report_dir.glob("*.ndjson"):
        for line in path.read_text().splitlines():
            recorder = (json.loads(line).get("ScenarioFinished") or {}).get("recorder") or {}
            for cid, case in (recorder.get("cases") or {}).items():
                value, answer = case["value"], (recorder["interactions"].get(cid) or {}).get("response")
                if value["meta"]["generation"]["mode"] != "positive" or answer is None or \
                        not 400 <= answer["status_code"] < 500 or answer["status_code"] in ACCEPTED:
                    continue
                message = _error_message(answer)
                if not any(re.search(rule, message) for rule in NO_SCHEMA_STATES):
                    refused.add(f"{value['method']} {value['path']}: {message}")
    return sorted(refused)


def _error_message(answer: dict) -> str:
    """The OpenAI error message of a recorded response (its status when it has none)."""
    content = answer.get("content") or {}
    try:
        return json.loads(base64.b64decode(content["$base64"]))["error"]["message"]
    except (KeyError, TypeError, ValueError):
        return f"status {answer['status_code']}"


def _st() -> str:
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        st = Path(shutil.which("st") or "st")
    return str(st)


SERVE_ARGS = ("--no-daemon", "--dtype", "float32", "--max-model-len", "64", "--threads", "1",
              "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def servers(tiny_llama) -> Iterator[dict[str, ServeProcess]]:
    """The two servers of the module: "open" (no key; test_schema_tells_the_truth reads it too) and "api-key".
    Each must still exit 0 at the end, after everything the fuzzing sent it."""
    started: dict[str, ServeProcess] = {}
    try:
        started["open"] = ServeProcess(tiny_llama, *SERVE_ARGS)
        started["api-key"] = ServeProcess(tiny_llama, *SERVE_ARGS, "--api-key", API_KEY)
        yield started
    finally:
        codes = {variant: server.stop() for variant, server in started.items()}
    assert codes == {variant: 0 for variant in started}, codes


@dataclass
class FuzzRun:
    proc: subprocess.Popen
    cwd: Path

    def output(self) -> str:
        return (self.cwd / "st.out").read_text() + (self.cwd / "st.err").read_text()


@pytest.fixture(scope="module")
def fuzz_runs(servers, tmp_path_factory) -> Iterator[dict[str, FuzzRun]]:
    """Both schemathesis runs, started at once against their own server: a run spends most of its time waiting
    for its server's answers, so on two cores the pair takes about as long as one alone."""
    runs: dict[str, FuzzRun] = {}
    for variant, server in servers.items():
        cwd = tmp_path_factory.mktemp(f"fuzz-{variant}")
        headers = {"Authorization": f"Bearer {API_KEY}"} if variant == "api-key" else {}
        # With a key the schema itself is behind it: fetch it here, point schemathesis at the file and the server.
        schema = httpx.get(server.base + "/openapi.json", headers=headers)
        assert schema.status_code == 200, schema.text
        (cwd / "openapi.json").write_bytes(schema.content)
        cmd = [_st(), "run", "openapi.json", "--url", server.base, "--checks", CHECKS, "--max-examples",
               str(MAX_EXAMPLES), "--seed", "17", "--workers", "1", "--no-shrink", "--request-timeout", "60",
               "--phases", "examples,coverage,fuzzing", "--report", "ndjson", "--report-dir", "report"]
        if headers:
            cmd += ["-H", f"Authorization: Bearer {API_KEY}"]
        with open(cwd / "st.out", "w") as out, open(cwd / "st.err", "w") as err:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, text=True,
                                    env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"})
        runs[variant] = FuzzRun(proc, cwd)
    try:
        yield runs
    finally:
        for run in runs.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()


@pytest.mark.parametrize("variant", ["open", "api-key"])
def test_schemathesis_finds_no_failures(servers, fuzz_runs, variant: str) -> None:
    server, run = servers[variant], fuzz_runs[variant]
    run.proc.wait(timeout=400)
    out = run.output()
    assert run.proc.returncode == 0, out[-12000:]
    assert " passed" in out and "failed" not in out.split("SUMMARY")[-1], out[-3000:]
    refused = valid_but_refused(run.cwd / "report")
    assert not refused, "schema-valid requests refused:\n" + "\n".join(refused[:20])
    # The server survived all of it and still answers.
    headers = {"Authorization": f"Bearer {API_KEY}"} if variant == "api-key" else {}
    assert httpx.get(server.base + "/health").status_code == 200
    ok = httpx.post(server.base + "/v1/completions", headers=headers,
                    json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_schema_tells_the_truth(servers) -> None:
    """What the fuzzing relies on, stated directly: no 422, errors documented, non-JSON routes not JSON, strict
    token ids (``prompt: [[false]]`` is not token 0)."""
    server = servers["open"]
    schema = httpx.get(server.base + "/openapi.json").json()
    ops = [op for methods in schema["paths"].values() for op in methods.values()]
    assert all("422" not in op["responses"] for op in ops)
    post = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "404", "503"} <= set(post) and set(post["200"]["content"]) == {"application/json",
                                                                                  "text/event-stream"}
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": [[False]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    # Issue 18's routes are documented as they answer: /v1/responses streams or returns JSON, /ping has no
    # body (200 or 503), /tokenize and /detokenize return JSON.
    responses = schema["paths"]["/v1/responses"]["post"]["responses"]
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    for method in ("get", "post"):
        ping = schema["paths"]["/ping"][method]["responses"]
        assert set(ping) == {"200", "503"} and all("content" not in v for v in ping.values()), ping
    for path in ("/tokenize", "/detokenize"):
        assert set(schema["paths"][path]["post"]["responses"]["200"]["content"]) == {"application/json"}
    # Unknown top-level fields are accepted (issue 18, as vLLM), so the schema must not forbid them; a known
    # field of the wrong type is still a 400 naming it (issue 17).
    body = schema["components"]["schemas"]["CompletionRequest"]
    assert body.get("additionalProperties", True) is not False
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1,
                                                           "service_tier": "auto"})
    assert r.status_code == 200, r.text
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": True,
                                                           "service_tier": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    _schema_states_what_is_accepted(server, schema)


def _schema_states_what_is_accepted(server, schema: dict) -> None:
    """Issue 43, row 16: a 405 lists the path's methods; integer bounds are exact integers (FastAPI had made
    int64's maximum the float 2^63); this server's facts are stated (vocabulary, context, no request
    chat_template, no LoRA admin routes without their flags); 5.0 is the integer 5, as JSON Schema says."""
    for method, path, allow in (("TRACE", "/v1/completions", "POST"), ("DELETE", "/ping", "GET, POST")):
        r = httpx.request(method, server.base + path)
        assert r.status_code == 405 and r.headers.get("allow") == allow, (path, r.status_code, r.headers)
    bodies = schema["components"]["schemas"]
    seed = next(s for s in bodies["CompletionRequest"]["properties"]["seed"]["anyOf"] if s["type"] == "integer")
    assert (seed["minimum"], seed["maximum"]) == (-(1 << 63), (1 << 63) - 1)
    assert all(type(seed[k]) is int for k in ("minimum", "maximum"))
    assert bodies["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 511  # the tiny vocab: 512
    max_tokens = next(s for s in bodies["CompletionRequest"]["properties"]["max_tokens"]["anyOf"]
                      if s["type"] == "integer")
    assert max_tokens["maximum"] == 63 and bodies["ChatCompletionRequest"]["properties"]["chat_template"] == \
        {"type": "null", "description": "refused unless the server runs with --trust-request-chat-template"}
    assert "/v1/load_lora_adapter" not in schema["paths"] and "/v1/unload_lora_adapter" not in schema["paths"]
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": [1.0, 2], "max_tokens": 2.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
