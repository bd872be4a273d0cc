"""Issue 17 item 11: a daemon run under 1, 2, 8 or 16 OpenMP threads preloads bf16 weights packed for oneDNN, and
a worker with another thread count computes the same tokens as plain F.linear (real daemon processes; SmolLM2's
layer shapes, which oneDNN blocks differently at 16 threads). That the layout itself no longer depends on the
thread count is tested in-process (tests/unit/worker/test_request_isolation.py), where the thread count of the planning
and the packing thread can be made to differ."""

from __future__ import annotations

import os

import pytest
import torch
from support.daemon import DaemonProc, new_runtime_dir, remove_runtime_dir

from keepwarm import LLM, SamplingParams
from keepwarm.kernels import cpu_packed

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm_shaped(tmp_path_factory) -> str:
    """SmolLM2-135M's projection shapes ([576, 576], [960, 576], [1536, 576], [576, 1536]) in two small layers."""
    from keepwarm.worker.models.random_model import make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("smollm_shaped"), "llama", vocab_size=2048,
                                 hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                 tie_word_embeddings=True, initializer_range=0.05))


@pytest.fixture(scope="module")
def reference(smollm_shaped) -> list[list[int]]:
    """Greedy tokens from a disk load without packing (plain F.linear) at this process's thread count."""
    before = os.environ.get(cpu_packed.ENV_VAR)
    os.environ[cpu_packed.ENV_VAR] = "0"
    try:
        llm = LLM(model=smollm_shaped, dtype="bfloat16", daemon=False, max_model_len=128)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.close()
    finally:
        if before is None:
            os.environ.pop(cpu_packed.ENV_VAR)
        else:
            os.environ[cpu_packed.ENV_VAR] = before
    return tokens


@pytest.mark.parametrize("daemon_threads", [1, 2, 8, 16])
def test_daemon_thread_count_does_not_change_the_tokens(smollm_shaped, reference, daemon_threads: int) -> None:
    if not cpu_packed.packing_available(torch.bfloat16):
        pytest.skip("bfloat16 weight packing unavailable here (mkldnn bf16 support or libtorch's C shim)")
    runtime_dir = new_runtime_dir()
    daemon = DaemonProc(runtime_dir, env={"OMP_NUM_THREADS": str(daemon_threads)}).start()
    before = torch.get_num_threads()
    try:
        llm = LLM(model=smollm_shaped, dtype="bfloat16", daemon=True, runtime_dir=str(runtime_dir),
                  max_model_len=128)  # the daemon preloads (packs) under its own thread count
        try:
            assert llm.weights_source == "daemon"
            assert isinstance(llm.llm_engine.loaded.model.model.layers[0].self_attn.qkv_proj.weight,
                              cpu_packed.PackedWeight)
            for worker_threads in sorted({1, 2} - {daemon_threads} or {1}):
                torch.set_num_threads(worker_threads)
                assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        finally:
            llm.close()
    finally:
        torch.set_num_threads(before)
        daemon.stop()
        remove_runtime_dir(runtime_dir)
