"""schemathesis against a running `keepwarm serve`, over the server's own /openapi.json (issue 17, item 10).

The server must never answer 5xx to what a client sends, must answer only the statuses and content types its
schema documents, and its JSON bodies must match the documented response schemas. schemathesis runs as its CLI
from a temporary directory (never the repository root: its folders shadow installed packages), with a fixed
seed and a bounded number of examples per operation, against a small --max-model-len so each case is quick.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _serve import ServeProcess

pytestmark = pytest.mark.slow

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
MAX_EXAMPLES = 20
API_KEY = "fuzz-key"


def _st() -> str:
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        st = Path(shutil.which("st") or "st")
    return str(st)


@pytest.mark.parametrize("with_key", [False, True], ids=["open", "api-key"])
def test_schemathesis_finds_no_failures(tiny_llama, tmp_path, with_key: bool) -> None:
    extra = ["--api-key", API_KEY] if with_key else []
    server = ServeProcess(tiny_llama, "--no-daemon", "--dtype", "float32", "--max-model-len", "64",
                          "--threads", "1", "--served-model-name", "tiny", *extra)
    try:
        import httpx

        headers = {"Authorization": f"Bearer {API_KEY}"} if with_key else {}
        # With a key the schema itself is behind it: fetch it here, point schemathesis at the file and the server.
        schema = httpx.get(server.base + "/openapi.json", headers=headers)
        assert schema.status_code == 200, schema.text
        (tmp_path / "openapi.json").write_bytes(schema.content)
        cmd = [_st(), "run", "openapi.json", "--url", server.base, "--checks", CHECKS, "--max-examples",
               str(MAX_EXAMPLES), "--seed", "17", "--workers", "1", "--no-shrink", "--request-timeout", "60",
               "--phases", "examples,coverage,fuzzing"]
        if with_key:
            cmd += ["-H", f"Authorization: Bearer {API_KEY}"]
        run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400,
                             env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"})
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-12000:]
        assert " passed" in out and "failed" not in out.split("SUMMARY")[-1], out[-3000:]
        # The server survived all of it and still answers.
        assert httpx.get(server.base + "/health").status_code == 200
        ok = httpx.post(server.base + "/v1/completions", headers=headers,
                        json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        assert server.stop() == 0


def test_schema_tells_the_truth(tiny_llama) -> None:
    """What the fuzzing relies on, stated directly: no 422, errors documented, non-JSON routes not JSON, strict
    token ids (``prompt: [[false]]`` is not token 0)."""
    import httpx

    server = ServeProcess(tiny_llama, "--no-daemon", "--dtype", "float32", "--max-model-len", "64",
                          "--threads", "1", "--served-model-name", "tiny")
    try:
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
    finally:
        assert server.stop() == 0
