"""kernels/cpu_malloc.py: with the thresholds raised, the freed big activations of a step (40 / 20 / 20 MB, like a
prefill chunk's gate/up, its half and their product) are reused by the next steps; with KEEPWARM_CPU_MALLOC=0
glibc decides by its moving thresholds, and the steps fault in anywhere from a quarter to all of their pages again.
Measured here (one thread, six steps, 122,880 pages touched): ~5,100 faults with the tuning; without it
30,600-122,700 from one fresh process to the next (the same code: where the heap can grow decides). The test asks
for at most an eighth of the pages with the tuning, and fewer than without: it fails if the tuning does nothing.
Fresh processes: malloc's state is per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import resource, torch
    from keepwarm.kernels.cpu_malloc import keep_freed_memory
    torch.set_num_threads(1)  # one thread, one malloc arena: the same blocks every run
    print(keep_freed_memory())
    def step():
        a = torch.empty(20 << 20, dtype=torch.bfloat16)
        a.fill_(1.0)
        b = torch.empty(10 << 20, dtype=torch.bfloat16)
        b.fill_(2.0)
        c = a[: 10 << 20] * b
        del a, b, c
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(env_value: str) -> tuple[str, int]:
    env = {**os.environ, "KEEPWARM_CPU_MALLOC": env_value}
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    said, faults = run.stdout.strip().splitlines()[-2:]
    return said, int(faults)


def test_freed_activations_are_reused_not_faulted_in() -> None:
    said, tuned = _faults("1")
    assert said == "malloc keeps freed blocks for reuse (mmap and trim thresholds 1 GiB)"
    said, default = _faults("0")
    assert said == "malloc left as is (KEEPWARM_CPU_MALLOC=0)"
    eighth = 6 * (80 << 20) // 4096 // 8  # an eighth of the pages six steps touch
    assert tuned <= eighth and tuned < default, (tuned, default)
