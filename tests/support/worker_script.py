"""A worker process for the daemon tests: attach (or load from disk), generate greedily, report as JSON.

    python tests/support/worker_script.py MODEL --daemon on|off [--quantization Q] [--hold]

With --hold it then reads commands from stdin: "write" (try to modify a weight in place), "tokens" (generate
again), "exit".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

torch.set_num_threads(1)

from keepwarm import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 200, 300]]


def memory() -> dict:
    import psutil

    info = psutil.Process().memory_full_info()
    arena = {"private": 0, "shared": 0, "rss": 0}
    with open(f"/proc/{os.getpid()}/smaps") as f:
        in_arena = False
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                in_arena = len(parts) >= 6 and parts[-1].endswith(".arena")
            elif in_arena and parts[0] in ("Private_Clean:", "Private_Dirty:"):
                arena["private"] += int(parts[1]) * 1024
            elif in_arena and parts[0] in ("Shared_Clean:", "Shared_Dirty:"):
                arena["shared"] += int(parts[1]) * 1024
            elif in_arena and parts[0] == "Rss:":
                arena["rss"] += int(parts[1]) * 1024
    return {"uss": info.uss, "pss": info.pss, "rss": info.rss, "arena": arena}


def tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--daemon", default="on")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--hold", action="store_true")
    a = ap.parse_args()
    llm = LLM(model=a.model, dtype="float32", max_model_len=256, num_gpu_blocks=64,
              daemon={"on": True, "off": False, "auto": "auto"}[a.daemon], quantization=a.quantization)
    engine = llm.llm_engine
    # Touch every weight page so a disk load's pages count as this process's own.
    weight_bytes = sum(t.numel() * t.element_size() for t in (engine.loaded.model.model.embed_tokens.weight,))
    report = {"pid": os.getpid(), "source": llm.weights_source, "tokens": tokens(llm), "memory": memory(),
              "weights_bytes": engine.loaded.nbytes, "embed_bytes": weight_bytes,
              "fingerprint": engine.loaded.fingerprint,
              "lease": engine.loaded.attachment.lease_id if engine.loaded.attachment else None}
    print(json.dumps(report), flush=True)
    if not a.hold:
        llm.close()
        return
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "write":
            w = engine.loaded.model.model.embed_tokens.weight
            w.add_(1.0)  # must fault on a read-only arena mapping
            print(json.dumps({"wrote": True}), flush=True)
        elif cmd == "tokens":
            print(json.dumps({"tokens": tokens(llm)}), flush=True)
        elif cmd == "lease":
            att = engine.loaded.attachment
            print(json.dumps({"lease": att.lease_id, "reattaches": att.keeper.reattaches}), flush=True)
        elif cmd == "exit":
            break
    llm.close()


if __name__ == "__main__":
    main()
