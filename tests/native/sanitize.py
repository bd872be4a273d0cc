"""`make test-sanitizers`: keepwarm's C kernels built three ways and run under tests/native/kw_test.c.

- plain: the library's own flags (kernels/cpu_native.py: -O3, each file's -m flags) plus -Werror;
- asan+ubsan: AddressSanitizer and UndefinedBehaviorSanitizer, any report fatal (also -Werror);
- tsan: ThreadSanitizer over the thread pool and every kernel's slices (no OpenMP: libgomp is not instrumented).
The build is the one this CPU gets (avx512 or avx2), from the same file list and flags as the runtime build. A
sanitizer whose runtime is missing (libasan / libubsan / libtsan) is skipped with the reason on stderr; a missing
compiler or a CPU without AVX2 skips everything, said the same way. Exit status: 0, or 1 on a build failure, a
mismatch or a sanitizer report. About 30-40 s on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from keepwarm.kernels import cpu_native

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("kw_test.c")
SAN = {
    "plain": (),
    "asan+ubsan": ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"),
    "tsan": ("-fsanitize=thread", "-g"),
}
ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
       "TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0"}


def _skip(what: str, why: str) -> None:
    print(f"test-sanitizers: SKIPPED {what}: {why}", file=sys.stderr)


def _runtime_works(cc: str, flags: tuple[str, ...], work: Path) -> str:
    """"" when a trivial program builds and runs with `flags`, else why not."""
    src = work / "probe.c"
    src.write_text("#include <stdlib.h>\nint main(void) { free(malloc(8)); return 0; }\n")
    exe = work / "probe"
    built = subprocess.run([cc, *flags, str(src), "-o", str(exe)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        return (built.stderr.strip().splitlines() or ["cannot link"])[-1]
    ran = _run([str(exe)])
    return "" if ran.returncode == 0 else (ran.stderr.strip().splitlines() or ["probe failed"])[-1]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "3"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    if done.returncode != 0 and "unexpected memory mapping" in done.stderr and shutil.which("setarch"):
        # TSan on kernels with wide mmap randomization: the same run without ASLR
        done = subprocess.run(["setarch", os.uname().machine, "-R", *cmd], capture_output=True, text=True, env=env,
                              timeout=300, check=False)
    return done


def _build(cc: str, variant: str, name: str, work: Path) -> Path:
    """The variant's files compiled with the library's flags and `name`'s, linked with the driver."""
    san = SAN[name]
    opt = ("-O1",) if san else ()  # after -O3: sanitized builds compile and report faster at -O1
    objdir = work / name
    objdir.mkdir()
    objs = cpu_native.compile_objects(cc, cpu_native.variants()[variant], (*opt, "-Werror", *san), objdir)
    exe = work / f"kw_test-{name}"
    driver = ("-DKW_TEST_AVX512",) if variant == "avx512" else ()
    subprocess.run([cc, *cpu_native.COMMON_FLAGS, *opt, "-Werror", *san, *driver, f"-I{cpu_native.CSRC}",
                    str(DRIVER), *map(str, objs), "-o", str(exe), "-lm"], check=True)
    return exe


def main() -> int:
    cc = cpu_native.compiler()
    variant = cpu_native.variant_for(cpu_native.cpu_flags())
    if cc is None or not variant:
        _skip("every build", "no C compiler (cc) on PATH" if cc is None else "the CPU lacks AVX2 / FMA")
        return 0
    failed = []
    with tempfile.TemporaryDirectory(prefix="kw-sanitize-") as tmp:
        work = Path(tmp)
        for name, san in SAN.items():
            why = _runtime_works(cc, san, work) if san else ""
            if why:
                _skip(name, f"{cc} cannot build and run with {' '.join(san[:1])}: {why}")
                continue
            try:
                exe = _build(cc, variant, name, work)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                failed.append(f"{name}: build failed ({e})")
                continue
            done = _run([str(exe), *(["--tsan"] if name == "tsan" else [])])
            print(f"test-sanitizers: {name} ({variant} build): {done.stdout.strip() or 'no output'}")
            if done.returncode != 0:
                failed.append(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
    for f in failed:
        print(f"test-sanitizers: FAILED {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
