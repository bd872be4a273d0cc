"""Issue 43 rows 1-4 against `keepwarm serve` (the bundled SmolLM2, --no-daemon): status, seconds, peak-RSS growth
(VmHWM) and the worst /health latency while each request is handled. Run from outside the repository root:
`cd /tmp && OMP_NUM_THREADS=2 <checkout>/.venv/bin/python <checkout>/benchmarks/request_budget_rows.py`."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.serve import ServeProcess  # noqa: E402


def hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM")


def row(s: ServeProcess, name: str, body: dict) -> None:
    before, worst, done = hwm(s.proc.pid), [0.0], threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=s.base, timeout=30) as c:
            while not done.is_set():
                t = time.monotonic()
                c.get("/health")
                worst[0] = max(worst[0], time.monotonic() - t)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    t0 = time.monotonic()
    r = httpx.post(s.base + "/v1/completions", content=json.dumps(body),
                   headers={"Content-Type": "application/json"}, timeout=600)
    took = time.monotonic() - t0
    done.set()
    prober.join()
    msg = r.json().get("error", {}).get("message", "")[:110] if r.status_code != 200 else ""
    print(f"{name}: {r.status_code} in {took:.2f}s, peak RSS +{(hwm(s.proc.pid) - before) >> 20} MiB, "
          f"/health worst {worst[0] * 1000:.0f} ms; {msg}", flush=True)


def main() -> None:
    s = ServeProcess("--no-daemon", "--threads", "2", timeout=300)
    try:
        row(s, "row 1 3,000,000 prompts", {"prompt": ["a"] * 3_000_000, "max_tokens": 1})
        row(s, "row 2 10,000 prompts", {"prompt": ["a"] * 10_000, "max_tokens": 1})
        row(s, "row 3 2,000 prompts x n=16", {"prompt": ["a"] * 2000, "n": 16, "max_tokens": 1})
        row(s, "largest passing: 256 prompts x 170 tokens", {"prompt": ["word " * 170] * 256, "max_tokens": 1})
        print(json.dumps(httpx.get(s.base + "/keepwarm/config").json()["request_limits"]))
    finally:
        s.stop()
    s = ServeProcess("--no-daemon", "--threads", "2", "--max-num-seqs", "4", "--max-queued-requests", "4",
                     timeout=300)
    try:
        row(s, "row 4 200 prompts on --max-num-seqs 4 --max-queued-requests 4",
            {"prompt": ["a"] * 200, "max_tokens": 1})
        codes: list[int] = []

        def one() -> None:
            codes.append(httpx.post(s.base + "/v1/completions", timeout=300,
                                    json={"prompt": "a", "max_tokens": 64, "ignore_eos": True}).status_code)

        with ThreadPoolExecutor(16) as pool:
            for _ in range(16):
                pool.submit(one)
        print("16 single requests at once:", sorted(codes))
    finally:
        s.stop()


if __name__ == "__main__":
    main()
