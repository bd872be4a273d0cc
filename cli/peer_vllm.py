"""Runs inside vLLM's own virtual environment (never imported by keepwarm): offline throughput of vLLM's `LLM`
on the prompts keepwarm's benchmark gives it, printed as one JSON line per concurrency.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 /path/to/vllm-venv/bin/python peer_vllm.py SPEC.json
"""

import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams  # deferred: vLLM is in its own venv only, where this runs as a script

    t0 = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              **spec.get("llm_kwargs", {}))
    print(json.dumps({"event": "ready", "init_s": time.perf_counter() - t0}), flush=True)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = spec["prompts"]
    for n in spec["concurrency"]:
        batch = [{"prompt_token_ids": p} for p in prompts[:n]]
        llm.generate(batch, params, use_tqdm=False)  # warm-up of the same shape
        times, tokens = [], 0
        for _ in range(spec["repeats"]):
            llm.reset_prefix_cache()  # as keepwarm's rows do: measure compute, not cache hits
            t = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        best = min(times)
        print(json.dumps({"event": "result", "concurrency": n, "output_tokens": tokens, "seconds": best,
                          "tokens_per_s": tokens / best,
                          "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs[:2]]}), flush=True)


if __name__ == "__main__":
    main()
