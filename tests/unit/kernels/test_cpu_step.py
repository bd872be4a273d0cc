"""The native decode step (kernels/csrc/step.c, kernels/cpu_step.py, worker/models/native_step.py): a decode-only
CPU step's layers in one C call.
- SiLU times up: every bf16 gate value (65,536) against random ups equals ATen's ``F.silu(g).mul_(u)`` bit for bit;
- a GGUF llama of int8-group weights (Q4_K + Q6_K in groups of 16, Q4_K as 4-bit codes, Q8_0): per layer, the
  step made of the first k layers equals the first k layers run op by op, bit for bit, in every decode step; end to
  end, greedy tokens and every logprob equal the op-by-op path's (``KEEPWARM_CPU_STEP=0``), with steps of 3, 2 and 1
  rows, at 1 and 2 threads, and a sequence's outputs alone equal its outputs in a batch;
- int4 (Q4_0 / Q4_1, torch's halves pack): at 1-4 rows on AVX-512 ATen's op is replaced by keepwarm's int4 kernel
  on the same pack (`NativeStep.exact` says so): per layer within BOUND of op by op; greedy tokens equal; the same
  for BF16 files where F.linear runs (the AVX2 bf16 kernel in its place); on AVX512-BF16 their 1-4 rows are the
  dispatch's own kernel, so the step equals op by op there bit for bit;
- a forked child runs the step and gets its parent's bits;
- what the step does not compute exactly runs op by op, logged once with its reason: a float32 model, the switch.
BOUND (int4 substitute): both kernels sum the same exact products x * w in float32 in different orders; per output
|a - b| <= 2 (K / 8 + 8) 2^-24 |x| @ |w|^T before the bf16 rounding, which adds one bf16 ulp of each: the layers
then carry the difference on. Asserted per layer as max |a - b| <= 2^-5 * max |b| + 2^-6 (measured: <= 2^-9 max |b|).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from support.tiny_gguf import tiny_gguf_dir

from keepwarm import LLM, SamplingParams
from keepwarm.kernels import cpu_native, cpu_step
from keepwarm.worker.models import native_step

pytestmark = pytest.mark.skipif(not cpu_native.glue_on() or cpu_step.exp8_address() is None,
                                reason=f"native kernels: {cpu_native.reasons()[1] or 'no Sleef expf in torch'}")

# layer 0: qkv int8 groups of 16 (Q4_K beside Q6_K), gate_up 4-bit codes (Q4_K alone: int8_group_u4); layer 1: Q8_0
INT8_GROUPS = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_K",
     "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {p: "Q8_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
]
SUBSTITUTED = {t: {p: t for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
               for t in ("Q4_0", "Q4_1", "BF16")}
PROMPTS = [[5, 17, 99, 240, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 12, 45, 8]]
# finishing at different lengths: decode steps of 3, then 2, then 1 rows
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (4, 8, 12)]


def test_silu_mul_is_atens_bit_for_bit() -> None:
    g = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for up in (torch.ones_like(g), torch.randn(g.shape, generator=torch.Generator().manual_seed(0)).bfloat16()):
        got = cpu_step.silu_mul(torch.cat([g, up], dim=1))
        want = F.silu(g).mul_(up)
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert bool(same.all()), f"{int((~same).sum())} of 65536 differ, e.g. gate {g[~same][:4].tolist()}"


@pytest.fixture
def per_layer(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, float, float]]:
    """Wraps DecodeStep.run: before each native step, the first k layers op by op against a step of the first k
    layers, for every k; records (rows, k, max |step - op by op|, max |op by op|) over the output and residual."""
    seen: list[tuple[int, int, float, float]] = []
    run = native_step.DecodeStep.run

    def checked(self: native_step.DecodeStep, x: torch.Tensor, attn: object) -> object:
        if native_step._step_refusal(x, attn) is None:
            rot, plan = attn.rotary["global"], attn.plan.decode[None]  # type: ignore[attr-defined]
            slots = attn.slot_mapping.long().contiguous()  # type: ignore[attr-defined]
            ref, res = x.clone(), None
            for k, layer in enumerate(self.modules, start=1):
                ref, res = layer(None, ref, res, self.cos_sin, attn, self.kv)
                part = cpu_step.make(self.native.shape, self.native.layers[:k])
                assert isinstance(part, cpu_step.NativeStep)
                got = part.run(x.clone(), rot.cos, rot.sin, slots, plan)
                assert got is not None
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, (ref, res), strict=True))
                seen.append((x.shape[0], k, diff, float(ref.float().abs().max())))
        return run(self, x, attn)

    monkeypatch.setattr(native_step.DecodeStep, "run", checked)
    return seen


def _generate(path: object, threads: int = 2, prompts: list[list[int]] = PROMPTS) -> list[tuple[object, object]]:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    llm = LLM(model=str(path), dtype="bfloat16", daemon=False, max_model_len=128)
    try:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                  PARAMS[-len(prompts):] if len(prompts) < 3 else PARAMS)]
    finally:
        llm.close()
        torch.set_num_threads(old)
    return [(o.token_ids, [{k: v.logprob for k, v in step.items()} for step in o.logprobs]) for o in outs]


def _count_steps(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[bool]]:
    """The rows of each step the C step ran, and whether it said it was exact (`NativeStep.exact`) at those rows."""
    rows: list[int] = []
    exact: list[bool] = []
    run = cpu_step.NativeStep.run

    def counted(self: cpu_step.NativeStep, x: torch.Tensor, *a: object) -> object:
        out = run(self, x, *a)  # type: ignore[arg-type]
        if out is not None:
            rows.append(x.shape[0])
            exact.append(self.exact(x.shape[0]))
        return out

    monkeypatch.setattr(cpu_step.NativeStep, "run", counted)
    return rows, exact


def test_int8_group_model_steps_equal_op_by_op_per_layer_and_end_to_end(tiny_llama, tmp_path, monkeypatch,
                                                                       per_layer) -> None:
    path, _ = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, INT8_GROUPS)
    rows, exact = _count_steps(monkeypatch)
    native = _generate(path)
    assert sorted(set(rows)) == [1, 2, 3], f"the step ran at rows {sorted(set(rows))}"
    assert all(exact), "int8-group kernels are the dispatch's own: the step must say it is exact"
    assert per_layer and {k for _, k, _, _ in per_layer} == {1, 2}
    assert all(d == 0.0 for _, _, d, _ in per_layer), f"per layer: {per_layer}"
    one_thread = _generate(path, threads=1)
    alone = _generate(path, prompts=PROMPTS[2:])
    monkeypatch.setenv(cpu_step.ENV_VAR, "0")
    rows.clear()
    op_by_op = _generate(path)
    assert not rows, "KEEPWARM_CPU_STEP=0 still ran the step"
    assert native == op_by_op, "the step's tokens or logprobs differ from op by op"
    assert one_thread == native, "1 thread and 2 threads differ"
    assert alone == native[2:], "a sequence alone differs from the same sequence in a batch"


@pytest.mark.parametrize("kind", list(SUBSTITUTED))
def test_substituted_kernels_step_within_the_bound(tiny_llama, tmp_path, monkeypatch, per_layer, kind) -> None:
    types = SUBSTITUTED[kind]
    path, _ = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, [types, types])
    rows, _ = _count_steps(monkeypatch)
    native = _generate(path)
    assert sorted(set(rows)) == [1, 2, 3]
    assert per_layer
    for n, k, diff, mag in per_layer:
        assert diff <= 2 ** -5 * mag + 2 ** -6, f"{n} rows, layers 1..{k}: {diff} of {mag}"
    monkeypatch.setenv(cpu_step.ENV_VAR, "0")
    op_by_op = _generate(path)
    assert [t for t, _ in native] == [t for t, _ in op_by_op]
    for (_, a), (_, b) in zip(native, op_by_op, strict=True):
        for sa, sb in zip(a, b, strict=True):
            for tok in sa.keys() & sb.keys():
                assert abs(sa[tok] - sb[tok]) <= 0.1 + 0.01 * abs(sb[tok]), (sa, sb)  # bf16 logits: coarse


@pytest.mark.skipif(not cpu_native.available(), reason=f"the AVX512-BF16 build: {cpu_native.reasons()[0]}")
def test_bf16_model_steps_equal_op_by_op_where_the_few_rows_kernel_runs(tiny_llama, tmp_path, monkeypatch,
                                                                       per_layer) -> None:
    """On AVX512-BF16 a dense bf16 linear of 1-4 rows is the dispatch's own C kernel (kw_bgemv512), so a BF16 file's
    step is exact there: per layer and end to end the op-by-op path's bits."""
    types = SUBSTITUTED["BF16"]
    path, _ = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, [types, types])
    rows, exact = _count_steps(monkeypatch)
    native = _generate(path)
    assert sorted(set(rows)) == [1, 2, 3] and all(exact)
    assert per_layer and all(d == 0.0 for _, _, d, _ in per_layer), f"per layer: {per_layer}"
    monkeypatch.setenv(cpu_step.ENV_VAR, "0")
    assert _generate(path) == native


def test_a_forked_child_runs_the_step_with_its_parents_bits(tiny_llama, tmp_path, monkeypatch) -> None:
    """The library's pool does not survive a fork (nor does torch's OpenMP team: its own ops hang in a forked child
    of a process that ran them): the child's step at 2 threads starts a pool of its own and gets the same bits."""
    path, _ = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, INT8_GROUPS)
    calls: list[tuple[cpu_step.NativeStep, tuple[torch.Tensor, ...]]] = []
    run = cpu_step.NativeStep.run

    def kept(self: cpu_step.NativeStep, *a: torch.Tensor) -> object:
        calls.append((self, tuple(t.clone() for t in a)))
        return run(self, *a)

    monkeypatch.setattr(cpu_step.NativeStep, "run", kept)
    torch.set_num_threads(2)
    llm = LLM(model=str(path), dtype="bfloat16", daemon=False, max_model_len=128)
    try:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS[1])
        assert calls, "the step did not run"
        step, args = calls[-1]  # the last step: its context is in the pools as it was
        want = run(step, *(t.clone() for t in args))
        assert want is not None
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child runs only the step (C): 0 when its bits are the parent's
            got = run(step, *(t.clone() for t in args))
            same = got is not None and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            os.write(w, b"same" if same else b"differ")
            os._exit(0)
        os.close(w)
        child = os.read(r, 64)
        os.waitpid(pid, 0)
    finally:
        llm.close()
    assert child == b"same"


def test_what_the_step_cannot_compute_runs_op_by_op_and_says_why(tiny_llama, tmp_path, monkeypatch, caplog) -> None:
    path, _ = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, INT8_GROUPS)
    rows, _ = _count_steps(monkeypatch)
    native_step._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="keepwarm.worker.models"):
        llm = LLM(model=str(path), dtype="float32", daemon=False, max_model_len=128)
        try:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS[0])
        finally:
            llm.close()
    assert not rows
    assert "the decode step runs op by op: activations in torch.float32, not bfloat16" in caplog.text
    native_step._log_once.cache_clear()
    caplog.clear()
    monkeypatch.setenv(cpu_step.ENV_VAR, "0")
    with caplog.at_level(logging.INFO, logger="keepwarm.worker.models"):
        _generate(path, prompts=PROMPTS[:1])
    assert not rows and f"the decode step runs op by op: {cpu_step.ENV_VAR}=0" in caplog.text
