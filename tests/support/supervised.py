"""Helpers for the tests of `keepwarm serve --zygote` (test_restart.py, test_standby.py): `keepwarm restart` as a
command, /health's and /keepwarm/config's views, and a load of greedy openai-client requests that records every
failed, cut-short or wrong answer."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import openai

from support.wait import wait_until

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "A restart that nobody notices"]
MAX_TOKENS = 12


def restart(server, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "restart", "--port", str(server.port),
                           *flags], env=server.env, capture_output=True, text=True, timeout=300)


def health(server) -> dict:
    return httpx.get(server.base + "/health", timeout=10).json()


def engine_config(server) -> dict:
    return httpx.get(server.base + "/keepwarm/config", timeout=10).json()["engine"]


class Load:
    """Client threads sending greedy requests without pause (streaming and not, completions and chat) through the
    official openai client with retries off: any refused, reset, failed or cut-short request is recorded."""

    def __init__(self, base: str, references: dict[tuple[str, str], str], threads: int = 3) -> None:
        self.base, self.references = base, references
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self, i: int) -> None:
        client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        n = i
        while not self.stop.is_set():
            prompt, kind = PROMPTS[n % len(PROMPTS)], ("stream", "plain", "chat")[n % 3]
            n += 1
            try:
                text, finish = ask(client, prompt, kind)
            except Exception as e:  # noqa: BLE001  (every failure is what this test counts)
                with self._lock:
                    self.errors.append(f"{kind} {prompt!r}: {type(e).__name__}: {e}")
                continue
            with self._lock:
                if finish != "length":
                    self.errors.append(f"{kind} {prompt!r}: finish_reason {finish!r} (truncated)")
                elif text != self.references[(prompt, kind)]:
                    self.errors.append(f"{kind} {prompt!r}: {text!r} != {self.references[(prompt, kind)]!r}")
                self.done += 1

    def wait_for(self, n: int, timeout: float = 120) -> None:
        target = self.done + n
        wait_until(lambda: self.done >= target, timeout,
                   message=lambda: f"the load stalled at {self.done} requests; errors: {self.errors[:5]}")


def ask(client: openai.OpenAI, prompt: str, kind: str) -> tuple[str, str | None]:
    extra = {"ignore_eos": True}
    if kind == "chat":
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body=extra)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    if kind == "plain":
        c = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=extra)
        return c.choices[0].text, c.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body=extra):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish
