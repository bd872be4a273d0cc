"""`keepwarm bench restart`'s zygote rows: `serve --zygote` restarted idle and under load, measured from outside.

Rules: a restart is `keepwarm restart`'s request on the control socket; "to first token" is timed on a request sent
once the restart answered, over a new connection (a kept-alive one would still reach the old worker), for a prompt
no worker computed and for the one the old worker served last (its blocks carried over); with ``--standby`` each idle
restart first waits for the next standby to be warmed. Under load, failed or cut-short requests are counted and the
longest gap between two tokens a client received is set beside STEADY_S seconds of the same load without restarts.
Nothing is asserted. The server runs with ``--shutdown-timeout 600`` so an old worker's drain is never cut short.
What each row means, and the figures: docs/benchmarks.md, "Restart to first token"."""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from keepwarm.worker.process import ipc

LOAD_CLIENTS = 2
LOAD_TOKENS = 24
STEADY_S = 3.0  # the stretch without restarts the gap is compared with


async def _stream(client: Any, base: str, prompt_ids: list[int], max_tokens: int) -> tuple[list[float], bool]:
    """One streaming completion: the arrival time of each token chunk, and whether it ran to its length."""
    body = {"model": "bench", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times: list[float] = []
    finish = None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return times, False
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice:
                    times.append(time.monotonic())
                    finish = choice[0]["finish_reason"] or finish
    return times, finish == "length"


class _Load:
    """Clients streaming back to back until stopped; per client the arrival times of every token."""

    def __init__(self, base: str, prompt_ids: list[int]) -> None:
        self.base, self.prompt_ids = base, prompt_ids
        self.stop = asyncio.Event()
        self.arrivals: list[list[float]] = [[] for _ in range(LOAD_CLIENTS)]
        self.failed = 0
        self.requests = 0

    async def run(self) -> None:
        import httpx  # deferred: ~80 ms, which `keepwarm --help` must not pay

        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(LOAD_CLIENTS)))

    async def _client(self, client: Any, i: int) -> None:
        import httpx  # deferred: ~80 ms, which `keepwarm --help` must not pay

        while not self.stop.is_set():
            try:
                times, complete = await _stream(client, self.base, self.prompt_ids, LOAD_TOKENS)
            except httpx.HTTPError:
                times, complete = [], False
            self.arrivals[i].extend(times)
            self.requests += 1
            self.failed += not complete

    def max_gap(self, start: float, end: float) -> float:
        """The longest stretch of [start, end] in which some client received no token (a window without any
        token counts whole)."""
        gaps = [0.0]
        for times in self.arrivals:
            points = [start, *(t for t in times if start < t < end), end]
            gaps += [b - a for a, b in zip(points, points[1:], strict=False)]
        return max(gaps)


async def _restart(port: int, rt: Path) -> Any:
    reply = await asyncio.to_thread(ipc.request_restart, port, ipc.RestartRequest(), rt)
    if not reply.ok:
        raise RuntimeError(f"restart failed: {reply.message}")
    return reply


async def _standby_pid(client: Any, base: str, previous: int | None, timeout: float = 300.0) -> int:
    """The pid of a warmed standby other than ``previous``, once /health reports one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = (await client.get(base + "/health")).json().get("restarts", {}).get("standby_pid")
        if pid is not None and pid != previous:
            return int(pid)
        await asyncio.sleep(0.02)
    raise RuntimeError(f"no standby worker warmed within {timeout:.0f}s")


async def _handoffs(base: str, port: int, rt: Path, prompt_ids: list[int], repeats: int, standby: bool) -> dict:
    import httpx  # deferred: ~80 ms, which `keepwarm --help` must not pay

    # 1. idle (as the warm restart row): the restart request to the first token of a request sent after it
    # A fresh client each time: a connection kept alive from the previous request would reach the old worker,
    # which answers what arrives over open connections while it drains. Each repeat restarts twice: the first
    # request after one is a prompt no worker has computed (its prompt rotated: no cached block), after the other
    # the prompt the old worker had just served (its blocks carried over).
    rows: dict[str, list[Any]] = {k: [] for k in ("to_first_token", "first_request", "handoff", "phases", "rearm",
                                                  "carried_to_first_token", "carried_first_request", "carried")}
    pid, t_prev = None, time.monotonic()
    for i in range(2 * repeats):
        carried = i % 2 == 1
        prompt = prompt_ids if carried else prompt_ids[i + 1:] + prompt_ids[:i + 1]
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as probe:
            if standby:
                pid = await _standby_pid(probe, base, pid)
                rows["rearm"].append(time.monotonic() - t_prev)
            if carried:
                await _stream(probe, base, prompt_ids, 1)  # the old worker serves it (a hit there, or computed)
            t0 = time.monotonic()
            reply = await _restart(port, rt)
            t1 = time.monotonic()
            times, _ = await _stream(probe, base, prompt, 4)
            health = (await probe.get(base + "/health")).json()
            if carried:
                rows["carried_to_first_token"].append(times[0] - t0)
                rows["carried_first_request"].append(times[0] - t1)
                rows["carried"].append(health.get("restarts", {}).get("last", {}).get("prefix_cache", {})
                                       .get("blocks", 0))
            else:
                rows["to_first_token"].append(times[0] - t0)
                rows["first_request"].append(times[0] - t1)
            rows["handoff"].append(reply.handoff_s)
            rows["phases"].append(health.get("startup", {}))
            t_prev = t1
    # 2. under load: the longest a client waited for a token, beside the same load without restarts
    load = _Load(base, prompt_ids)
    runner = asyncio.create_task(load.run())
    await asyncio.sleep(1.0)  # the load settles
    t_steady = time.monotonic()
    await asyncio.sleep(STEADY_S)
    t_restarts = time.monotonic()
    loaded = []
    for _ in range(repeats):
        loaded.append((await _restart(port, rt)).handoff_s)
        await asyncio.sleep(0.5)
    t_end = time.monotonic()
    load.stop.set()
    await runner
    return {"standby_rearm_s": rows["rearm"], "zygote_restart_to_first_token_s": rows["to_first_token"],
            "handoff_s": rows["handoff"], "zygote_first_request_s": rows["first_request"],
            "carried_restart_to_first_token_s": rows["carried_to_first_token"],
            "carried_first_request_s": rows["carried_first_request"], "prefix_blocks_carried": rows["carried"],
            "zygote_phases_s": median_phases(rows["phases"]),
            "handoff_under_load_s": loaded,
            "max_gap_under_restarts_s": load.max_gap(t_restarts, t_end),
            "max_gap_steady_s": load.max_gap(t_steady, t_restarts),
            "load_requests": load.requests, "load_failed": load.failed}


def zygote_rows(cmd: list[str], env: dict[str, str], port: int, rt: Path, prompt_ids: list[int], repeats: int,
                start: Any, kill: Any) -> dict:
    """Start `serve --zygote` (``cmd``), restart it ``repeats`` times under load; the row's figures (a ``--standby``
    in ``cmd``: restarts that take over a warmed standby)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per load request otherwise
    first_start_s, proc = start(cmd, env, port, "bench", prompt_ids)
    try:
        row = asyncio.run(_handoffs(f"http://127.0.0.1:{port}", port, rt, prompt_ids, repeats, "--standby" in cmd))
    finally:
        kill(proc, 15)
    row["zygote_first_start_s"] = first_start_s
    return row


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per startup phase (a worker's /health "startup"), its median over ``runs``."""
    names = dict.fromkeys(k for run in runs for k in run)
    return {k: round(statistics.median(run.get(k, 0.0) for run in runs), 4) for k in names}


def describe_phases(phases: dict[str, float]) -> str:
    return " ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items())


def describe(row: dict, label: str = "zygote") -> str:
    rearm = (f"; a new standby warmed {statistics.median(row['standby_rearm_s']):.2f}s after the previous restart"
             if row.get("standby_rearm_s") else "")
    median = statistics.median(row["zygote_restart_to_first_token_s"])
    return (f"  {label + ' restart to first token:':<34}{median:.2f}s  "
            f"{[round(x, 3) for x in row['zygote_restart_to_first_token_s']]} (handoff "
            f"{statistics.median(row['handoff_s']):.3f}s, first request to its first token "
            f"{statistics.median(row['zygote_first_request_s']):.3f}s{rearm})\n"
            f"  {'  a prompt the old worker served:':<34}"
            f"{statistics.median(row['carried_restart_to_first_token_s']):.2f}s  "
            f"{[round(x, 3) for x in row['carried_restart_to_first_token_s']]} (first request to its first token "
            f"{statistics.median(row['carried_first_request_s']):.3f}s; prefix-cache blocks carried over "
            f"{row['prefix_blocks_carried']})\n"
            f"  new worker's phases (ms, median): {describe_phases(row['zygote_phases_s'])}\n"
            f"  under load ({LOAD_CLIENTS} streaming clients): handoff "
            f"{statistics.median(row['handoff_under_load_s']):.2f}s, longest gap a client saw "
            f"{row['max_gap_under_restarts_s']:.3f}s ({row['max_gap_steady_s']:.3f}s without restarts); "
            f"{row['load_requests']} requests, {row['load_failed']} failed")
