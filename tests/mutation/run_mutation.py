"""`make mutation`: mutation testing (cosmic-ray, pinned in requirements-mutation.txt) of the modules whose logic
the fast unit tests must pin down. Outside CI: it is slow (one pytest run per mutant).

    python tests/mutation/run_mutation.py [MODULE ...] [--sample N] [--seed S] [--out DIR]

Each module is mutated in a sandbox copy of the repository (never the working tree, which stays usable), made
importable as the `keepwarm` package through a folder of links put first on PYTHONPATH; the tests run from /tmp
(the root's `keepwarm/` and `kernels/` folders would shadow packages). `--sample N` keeps N mutants per module,
drawn with a fixed seed (the full run is several hours on 2 cores). Per module: killed / survived / timeouts and
the surviving mutants' diffs, in DIR/<module>.txt; the scores go to DIR/summary.json. docs/testing.md records
the last run and how each survivor was judged.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_CR = ROOT / ".venv-mutation" / "bin"
PYTHON = ROOT / ".venv" / "bin" / "python"
# module -> (file, the fast tests that must kill its mutants)
MODULES = {
    "block_manager": ("worker/engine/block_manager.py", ["tests/unit/worker/engine/test_block_manager.py"]),
    "scheduler": ("worker/engine/scheduler.py", ["tests/unit/worker/engine/test_scheduler.py"]),
    "sampler": ("worker/sampler.py", ["tests/unit/worker/test_sampler.py"]),
    "daemon_protocol": ("daemon/protocol.py", ["tests/unit/daemon/test_daemon_protocol.py"]),
    "wire": ("formats/wire.py", ["tests/unit/formats/test_wire.py", "tests/unit/daemon/test_daemon_protocol.py"]),
    "snapshot_store": ("snapshot/store.py",
                       ["tests/unit/snapshot/test_snapshot_store.py", "tests/e2e/test_snapshot.py", "-m", "not slow"]),
}
PACKAGES = ("daemon", "formats", "worker", "kernels", "snapshot", "cli", "weights")


def make_sandbox(base: Path) -> tuple[Path, Path]:
    """A copy of the tracked tree at base/src, and base/pkg/keepwarm linking to it (the package layout)."""
    src, pkg = base / "src", base / "pkg" / "keepwarm"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").symlink_to(src / "keepwarm" / "__init__.py")
    for d in PACKAGES:
        (pkg / d).symlink_to(src / d)
    return src, pkg.parent


def test_command(src: Path, pkg_root: Path, tests: list[str]) -> str:
    """A shell command line (cosmic-ray runs it through ``bash -c``): the tests from /tmp, importing the sandbox."""
    args = " ".join(shlex.quote(str(src / t) if t.startswith("tests/") else t) for t in tests)
    return (f"cd /tmp && PYTHONPATH={pkg_root} OMP_NUM_THREADS=1 KEEPWARM_TEST_THREADS=1 {PYTHON} -m pytest -x -q "
            f"-p no:cacheprovider --rootdir {src} -c {src / 'pyproject.toml'} {args}")


def _forget_jobs(con: sqlite3.Connection, job_ids: list[str]) -> None:
    """Remove these mutants from the session (both tables), commit and close."""
    rows = [(j,) for j in job_ids]
    con.executemany("DELETE FROM mutation_specs WHERE job_id = ?", rows)
    con.executemany("DELETE FROM work_items WHERE job_id = ?", rows)
    con.commit()
    con.close()


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) (line, column) of every annotation in a module under ``from __future__ import annotations``:
    never evaluated, so a mutant inside one is equivalent by construction (none when the import is missing)."""
    tree = ast.parse(path.read_text())
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations"
               for a in n.names) for n in tree.body):
        return []
    anns: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            anns.append(node.returns)
            anns += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x]
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
    return [((x.lineno, x.col_offset), (x.end_lineno or x.lineno, x.end_col_offset or 0)) for x in anns if x]


def drop_annotation_mutants(db: Path, module: Path) -> int:
    """Remove the session's mutants that lie inside an annotation (see annotation_spans); returns how many."""
    spans = annotation_spans(module)
    con = sqlite3.connect(db)
    rows = con.execute("SELECT job_id, start_pos_row, start_pos_col FROM mutation_specs").fetchall()
    drop = [j for j, row, col in rows if any(lo <= (row, col) < hi for lo, hi in spans)]
    _forget_jobs(con, drop)
    return len(drop)


def sample(db: Path, n: int, seed: int) -> int:
    """Keep n of the session's mutants (seeded, in a stable order: job ids are random uuids); returns how many
    there were."""
    con = sqlite3.connect(db)
    ids = [r[0] for r in con.execute("SELECT job_id FROM mutation_specs ORDER BY operator_name, occurrence")]
    keep = set(random.Random(seed).sample(ids, n)) if n < len(ids) else set(ids)
    _forget_jobs(con, [i for i in ids if i not in keep])
    return len(ids)


def reopen_survivors(db: Path, src: Path, path: str) -> int:
    """--retest: forget the session's surviving mutants' results (so `exec` runs them again, against today's tests)
    and point their specs at this sandbox's copy of the module; returns how many there were."""
    con = sqlite3.connect(db)
    survivors = [r[0] for r in con.execute("SELECT job_id FROM work_results WHERE test_outcome = 'SURVIVED'")]
    con.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in survivors])
    con.execute("UPDATE mutation_specs SET module_path = ?", (str(src / path),))
    con.commit()
    con.close()
    return len(survivors)


def run_module(name: str, src: Path, pkg_root: Path, out: Path, n: int | None, seed: int,
               retest: bool = False) -> dict:
    path, tests = MODULES[name]
    cfg = out / f"{name}.toml"
    db = out / f"{name}.sqlite"
    if not retest:
        db.unlink(missing_ok=True)
    cmd = test_command(src, pkg_root, tests)
    cr_cmd = shlex.join(["bash", "-c", cmd])  # cosmic-ray splits the command itself, without a shell
    cfg.write_text(f'[cosmic-ray]\nmodule-path = "{src / path}"\ntimeout = 120.0\nexcluded-modules = []\n'
                   f"test-command = {json.dumps(cr_cmd)}\n\n[cosmic-ray.distributor]\nname = \"local\"\n")
    baseline = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if baseline.returncode != 0:
        raise SystemExit(f"{name}: the tests fail without any mutation:\n{baseline.stdout[-2000:]}")
    if retest:
        total = None
        print(f"{name}: re-testing {reopen_survivors(db, src, path)} surviving mutants", flush=True)
    else:
        subprocess.run([VENV_CR / "cosmic-ray", "init", cfg, db], check=True, cwd=src)
        dropped = drop_annotation_mutants(db, src / path)
        print(f"{name}: {dropped} mutants inside annotations left out (never evaluated: equivalent)", flush=True)
        total = sample(db, n, seed) if n else None
    subprocess.run([VENV_CR / "cosmic-ray", "exec", cfg, db], check=True, cwd=src)
    report = subprocess.run([VENV_CR / "cr-report", db, "--surviving-only", "--show-diff"], capture_output=True,
                            text=True, check=True).stdout
    (out / f"{name}.txt").write_text(report)
    con = sqlite3.connect(db)
    rows = con.execute("SELECT worker_outcome, test_outcome, COUNT(*) FROM work_results GROUP BY 1, 2").fetchall()
    con.close()
    count = {(w, t): n for w, t, n in rows}
    killed = count.get(("NORMAL", "KILLED"), 0)
    survived = count.get(("NORMAL", "SURVIVED"), 0)
    # Incompetent: cosmic-ray could not run the tests on it at all; left out of the score, never counted as killed.
    incompetent = count.get(("NORMAL", "INCOMPETENT"), 0)
    timeouts = count.get(("TIMEOUT", None), 0)  # the tests hang on it: detected, counted as killed
    run = sum(count.values())
    judged = killed + survived + timeouts
    if incompetent > judged:
        raise SystemExit(f"{name}: {incompetent} of {run} mutants could not be tested: see {db} (work_results.output)")
    return {"module": path, "tests": tests, "mutants_total": total, "mutants_run": run, "killed": killed,
            "timeouts": timeouts, "survived": survived, "incompetent": incompetent,
            "other": run - judged - incompetent, "score": round(100 * (killed + timeouts) / max(judged, 1), 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("modules", nargs="*", default=list(MODULES))
    ap.add_argument("--sample", type=int, default=None, help="mutants per module (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / ".mutation")
    ap.add_argument("--retest", action="store_true",
                    help="run the last session's surviving mutants again (after adding tests to kill them)")
    a = ap.parse_args()
    if not (VENV_CR / "cosmic-ray").exists():
        print(f"cosmic-ray is not installed in {VENV_CR.parent} (make mutation installs it)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    summary_path = a.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="kw-mutation-") as tmp:
        src, pkg_root = make_sandbox(Path(tmp))
        for name in a.modules:
            res = run_module(name, src, pkg_root, a.out, a.sample, a.seed, a.retest)
            if a.retest and name in summary:
                res["mutants_total"] = summary[name].get("mutants_total")
            summary[name] = res
            summary_path.write_text(json.dumps(summary, indent=1) + "\n")
            print(f"{name}: {res['score']}% killed ({res['killed']} killed, {res['timeouts']} timeouts, "
                  f"{res['survived']} survived, {res['incompetent']} incompetent of {res['mutants_run']} run; "
                  f"{res['mutants_total'] or 'all'} in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
