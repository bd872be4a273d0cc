"""Issue 43 rows 1-4: what one request may cost is bounded before any work (keepwarm.worker.http.budget), and
admission counts sequences, not HTTP requests (keepwarm.worker.http.limits.Admission).

Each row runs against a real `keepwarm serve` and asserts the status, the message, the time to answer, that an
ordinary client (the official `openai` client) is served meanwhile, and the server's peak memory (VmHWM from
/proc/<pid>/status) against a stated bound. Bodies the client library cannot send as they are (millions of
prompts) go out through httpx."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from support.serve import ServeProcess
from support.wait import wait_until

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 4
MAX_QUEUED = 4
MAX_MODEL_LEN = 512
PROMPT_TOKENS = 1000  # --max-request-prompt-tokens
# A row may raise the server's peak RSS by at most this much (row 1's 11.4 MiB body parses into a 3-million-entry
# list: ~24 MiB of pointers, twice while it is validated).
PEAK_BOUND = 192 << 20


def vm_hwm(pid: int) -> int:
    """The process's peak resident set (bytes), from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM line")


class BudgetServer(ServeProcess):
    def __init__(self, model: str, *args: str) -> None:
        super().__init__(model, "--no-daemon", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                         "--threads", "1", "--served-model-name", "tiny", *args)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0)

    def post(self, body: dict, route: str = "completions", timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/{route}", content=json.dumps(body),
                          headers={"Content-Type": "application/json"}, timeout=timeout)

    def ordinary(self) -> str:
        return self.client.completions.create(model="tiny", prompt="ok", max_tokens=2, temperature=0).choices[0].text


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = BudgetServer(tiny_llama, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED),
                     "--max-request-prompt-tokens", str(PROMPT_TOKENS))
    s.ordinary()  # warm: the baseline memory is a serving process's
    yield s
    assert s.stop() == 0, s.output()[-3000:]


def refused_meanwhile(server: BudgetServer, body: dict) -> tuple[httpx.Response, float, int]:
    """Send ``body``; meanwhile an ordinary client must be served. (response, seconds, peak RSS growth)."""
    before = vm_hwm(server.proc.pid)
    served: list[str] = []
    stop = threading.Event()

    def ordinary_client() -> None:
        while not stop.is_set():
            served.append(server.ordinary())

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(ordinary_client)
        time.sleep(0.2)
        t0 = time.monotonic()
        r = server.post(body)
        took = time.monotonic() - t0
        stop.set()
        other.result()
    assert served, "the ordinary client was not served while the big request was handled"
    return r, took, vm_hwm(server.proc.pid) - before


@pytest.mark.parametrize("row, body, words", [
    ("1: 3,000,000 prompts (11.4 MiB)", {"model": "tiny", "prompt": ["a"] * 3_000_000, "max_tokens": 1},
     "3000000 sequences"),
    ("2: 10,000 one-character prompts", {"model": "tiny", "prompt": ["a"] * 10_000, "max_tokens": 1},
     "10000 sequences"),
    ("3: 2,000 prompts x n=16", {"model": "tiny", "prompt": ["a"] * 2000, "n": 16, "max_tokens": 1},
     "32000 sequences"),
    ("4: 200 prompts past --max-num-seqs 4", {"model": "tiny", "prompt": ["a b"] * 200, "max_tokens": 1},
     "200 sequences"),
])
def test_a_request_past_its_sequence_budget_is_refused_at_once(server, row, body, words) -> None:
    r, took, grew = refused_meanwhile(server, body)
    assert r.status_code == 400, (row, r.text[:500])
    err = r.json()["error"]
    assert words in err["message"] and "--max-request-sequences" in err["message"], err
    assert err["param"] == "prompt"
    assert took < 10, f"{row}: answered after {took:.1f}s"
    assert grew < PEAK_BOUND, f"{row}: peak RSS grew {grew >> 20} MiB"
    server.ordinary()


def test_n_counts_as_sequences(server) -> None:
    r = server.post({"model": "tiny", "prompt": "a", "n": MAX_NUM_SEQS + 1, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = server.post({"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


def test_prompt_tokens_are_bounded(server) -> None:
    hundred = " ".join(["hello"] * 100)
    r = server.post({"model": "tiny", "prompt": [hundred] * MAX_NUM_SEQS, "max_tokens": 1})
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["prompt_tokens"]
    assert used <= PROMPT_TOKENS
    # Text: tokenized prompt by prompt until the sum passes the budget.
    r = server.post({"model": "tiny", "prompt": [hundred * 2] * MAX_NUM_SEQS, "max_tokens": 1})
    assert r.status_code == 400 and "--max-request-prompt-tokens" in r.json()["error"]["message"], r.text
    # Token ids: counted as sent.
    r = server.post({"model": "tiny", "prompt": [[5] * 300] * MAX_NUM_SEQS, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert f"more than {PROMPT_TOKENS} tokens" in r.json()["error"]["message"]
    # Characters that cannot fit in the budget are refused before the tokenizer sees them.
    r, took, _ = refused_meanwhile(server, {"model": "tiny", "prompt": ["x" * 900_000] * MAX_NUM_SEQS,
                                             "max_tokens": 1})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert took < 5


def test_tokenizing_stops_at_the_budget() -> None:
    """The prompts after the one that passes the budget are never tokenized (a list is not materialised)."""
    from keepwarm.worker.http.budget import RequestBudget
    from keepwarm.worker.openai.protocol import APIError

    seen: list[str] = []

    class Counting:
        def encode(self, text: str) -> list[int]:
            seen.append(text)
            return [1] * len(text)

    budget = RequestBudget(max_sequences=100, max_prompt_tokens=10, token_chars=4)
    assert asyncio.run(budget.tokenize(Counting(), ["abc", "defg"], "prompt")) == [[1] * 3, [1] * 4]
    seen.clear()
    with pytest.raises(APIError, match="more than 10 tokens") as info:
        asyncio.run(budget.tokenize(Counting(), ["abcd"] * 5, "prompt"))
    assert info.value.status == 400 and info.value.param == "prompt"
    assert seen == ["abcd"] * 3
    with pytest.raises(APIError, match="characters"):
        asyncio.run(budget.tokenize(Counting(), ["a" * 161], "prompt"))  # 10 tokens x 4 chars x slack 4


def test_admission_counts_sequences_the_same_budget_for_everyone(server) -> None:
    """Row 4: a request's sequences take seats as single requests do: with 8 seats (4 running + 4 queued), two
    requests of n=4 hold them all and a third request, of any size, gets 429 until one ends."""
    slow = {"model": "tiny", "prompt": "a", "n": 4, "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}
    rejected = server.metric("vllm:admission_rejections_total", reason="max_num_queued_reqs")
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(server.post, slow) for _ in range(2)]
        wait_until(lambda: server.metric("vllm:num_requests_running") +
                   server.metric("vllm:num_requests_waiting") >= 8, 30,
                   message="the two requests never got their 8 sequences in")
        with pytest.raises(openai.RateLimitError, match="sequences"):
            server.ordinary()
        r = server.post({"model": "tiny", "prompt": ["a", "b"], "max_tokens": 1})
        assert r.status_code == 429 and "needs" in r.json()["error"]["message"], r.text
        assert all(f.result().status_code == 200 for f in held)
    server.ordinary()  # the seats came back
    # vLLM's counter of admission refusals counts both 429s.
    assert server.metric("vllm:admission_rejections_total", reason="max_num_queued_reqs") == rejected + 2


@pytest.fixture(scope="module")
def default_server(tiny_llama):
    s = BudgetServer(tiny_llama)  # default limits: 256 sequences, the KV pool's tokens
    yield s
    assert s.stop() == 0, s.output()[-3000:]


@pytest.mark.parametrize("kind", ["text", "token ids"])
def test_health_answers_within_100ms_while_the_largest_request_is_admitted(default_server, kind) -> None:
    """The largest request the default budget passes (256 prompts, half the KV pool's tokens as text, all of
    it as token ids) is parsed, checked and tokenized (off the event loop, in chunks) while /health and /metrics
    keep answering: within 100 ms (p90; a tenth of the admission's span on a loaded machine) until its sequences
    reach the engine, and within 1 s while it runs."""
    s = default_server
    limits = httpx.get(s.base + "/keepwarm/config").json()["request_limits"]
    # The defaults, derived: --max-num-seqs (256) and the KV pool (256 x 512 tokens, under the CPU's 1 GiB).
    assert limits == {"max_request_sequences": 256, "max_request_prompt_tokens": 256 * MAX_MODEL_LEN,
                      "admission_seats": 256 + 1024}
    prompt = [7] * (MAX_MODEL_LEN - 16) if kind == "token ids" else " ".join(["word"] * (MAX_MODEL_LEN // 2 - 8))
    admitting: list[float] = []
    running: list[float] = []
    admit_span = [float("inf"), 0.0]  # first and last moment a probe answered while the request was admitted
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=s.base, timeout=5) as probe:
        big = pool.submit(s.post, {"model": "tiny", "prompt": [prompt] * 256, "max_tokens": 1})
        while not big.done():
            for path in ("/health", "/metrics"):
                t0 = time.monotonic()
                r = probe.get(path)
                took = time.monotonic() - t0
                assert r.status_code == 200
                in_flight = probe.get("/health").json()["engine"]["requests_in_flight"]
                (running if in_flight else admitting).append(took)
                if not in_flight:
                    admit_span[:] = [min(admit_span[0], t0), time.monotonic()]
            time.sleep(0.005)
        r = big.result()
    assert r.status_code == 200 and len(r.json()["choices"]) == 256, r.text[:300]
    admitting.sort()
    assert admitting, "no probe answered while the request was admitted"
    p90 = admitting[len(admitting) * 9 // 10]
    # 100 ms on a quiet machine; on a loaded one (a clean clone's suite beside other work saw 0.23 s over a long
    # admission) a tenth of the admission's span: a loop blocked by the admission would answer a probe or two, each
    # taking most of the span.
    span = admit_span[1] - admit_span[0]
    assert len(admitting) >= 5 and p90 < max(0.1, span / 10), \
        f"p90 {p90:.3f}s over {len(admitting)} probes while admitting ({span:.2f}s)"
    assert max(running, default=0) < 1.0, f"{max(running):.3f}s while running"
