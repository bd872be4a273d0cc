"""lm-evaluation-harness scores a local loglikelihood task through `keepwarm serve` (its `local-completions` model:
echo + logprobs on /v1/completions) exactly as its own `hf` backend does on the same model in float32.

The task is 40 four-way multiple-choice questions (160 scored continuations, sent 16 prompts per request) from
tests/data/capitals_mc.json (no dataset download). lm-eval
runs in a subprocess from a temporary folder: the repository root's `kernels/` would shadow the `kernels` package
transformers probes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.serve import ServeProcess

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1] / "data" / "capitals_mc.json"
TASK = """task: keepwarm_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
model, model_args, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["keepwarm_capitals"],
                              task_manager=TaskManager(include_path="."), batch_size=batch, log_samples=True)
r = res["results"]["keepwarm_capitals"]
lls = [[float(x[0]) for x in s["filtered_resps"]] for s in res["samples"]["keepwarm_capitals"]]
print("RESULT " + json.dumps({"acc": r["acc,none"], "acc_norm": r["acc_norm,none"], "lls": lls}))
"""


def start_lm_eval(cwd: Path, model: str, model_args: str, batch: int) -> subprocess.Popen:
    """lm-eval on the task, from ``cwd`` (its output to files there: a full pipe would stall it)."""
    cwd.mkdir(exist_ok=True)
    (cwd / "keepwarm_capitals.yaml").write_text(TASK.format(data=DATA))
    # One thread: on a busy 2-core machine two spinning OpenMP threads made each request 5-8x slower.
    env = {"OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(cwd / "stdout", "w") as out, open(cwd / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-c", RUN, model, model_args, str(batch)], cwd=cwd, text=True,
                                stdout=out, stderr=err, env={**os.environ, **env})


def lm_eval_result(proc: subprocess.Popen, cwd: Path) -> dict:
    proc.wait(timeout=900)
    stdout, stderr = (cwd / "stdout").read_text(), (cwd / "stderr").read_text()
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, stdout[-2000:] + stderr[-4000:]
    return json.loads(line[len("RESULT "):])


def test_lm_eval_local_completions_equals_hf_backend(tmp_path: Path) -> None:
    """The hf backend's run goes at the same time as the served one (one thread each: two cores)."""
    from keepwarm.worker.default_model import default_model

    model_dir = str(default_model())
    hf_run = start_lm_eval(tmp_path / "hf", "hf", f"pretrained={model_dir},dtype=float32,device=cpu", batch=8)
    try:
        server = ServeProcess(model_dir, "--no-daemon", "--dtype", "float32", "--max-model-len", "512",
                              "--served-model-name", "smollm2", "--threads", "1")
        try:
            served_run = start_lm_eval(
                tmp_path / "served", "local-completions", f"model=smollm2,base_url={server.base}/v1/completions,"
                f"tokenizer={model_dir},tokenized_requests=True,num_concurrent=1,max_retries=1", batch=16)
            served = lm_eval_result(served_run, tmp_path / "served")
        finally:
            assert server.stop() == 0
        hf = lm_eval_result(hf_run, tmp_path / "hf")
    finally:
        if hf_run.poll() is None:
            hf_run.kill()
            hf_run.wait()
    print(f"lm-eval keepwarm_capitals (40 items): keepwarm acc {served['acc']:.4f} acc_norm "
          f"{served['acc_norm']:.4f}; hf acc {hf['acc']:.4f} acc_norm {hf['acc_norm']:.4f}")
    assert served["acc"] == hf["acc"] and served["acc_norm"] == hf["acc_norm"]
    # Per choice, the summed continuation log-likelihoods agree to float32 rounding.
    diffs = [abs(a - b) for sa, sb in zip(served["lls"], hf["lls"], strict=True) for a, b in zip(sa, sb, strict=True)]
    assert max(diffs) < 1e-3, max(diffs)
    assert served["acc"] > 0.25  # SmolLM2 knows some capitals: the task measures something
