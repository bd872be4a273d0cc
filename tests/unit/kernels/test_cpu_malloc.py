"""kernels/cpu_malloc.py: with the thresholds raised, a step's freed big blocks (40 / 20 / 20 MB, like a prefill
chunk's gate/up, its half and their product) are reused by the next steps; with KEEPWARM_CPU_MALLOC=0 glibc maps
each afresh and the steps fault in all their pages again (122,722 of 122,880 here). The child allocates through
glibc's malloc itself, as torch's CPU allocator does: counted through torch tensors, the faults with the tuning
went from 0 to 61,440 between fresh processes depending on what else was imported (where the address space lets
the heap grow), which made the count a test of import order. It fails if the tuning does nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import ctypes, resource
    import torch  # what a serving process has loaded: its libraries shape the address space the heap grows in
    from keepwarm.kernels.cpu_malloc import keep_freed_memory
    print(keep_freed_memory())
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def step():
        blocks = []
        for mb in (40, 20, 20):
            p = libc.malloc(mb << 20)
            ctypes.memset(p, 1, mb << 20)
            blocks.append(p)
        for p in blocks:
            libc.free(p)
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
