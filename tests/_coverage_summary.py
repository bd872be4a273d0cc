"""Print branch coverage per package after `make test` (from the combined .coverage data; subprocesses included).

    python tests/_coverage_summary.py [--fail-under PERCENT]

One line per package (keepwarm.worker, keepwarm.worker.http, keepwarm.daemon, ...): statements and branches
covered, and the combined figure coverage.py reports (covered lines + branches over lines + branches).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_of(path: str) -> str:
    rel = Path(path).resolve().relative_to(ROOT)
    return ".".join(["keepwarm", *rel.parts[:-1]]) if rel.parts[0] != "keepwarm" else "keepwarm"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-under", type=float, default=0.0)
    a = ap.parse_args()
    import coverage

    cov = coverage.Coverage()
    cov.load()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cov.json_report(outfile=f.name)
        report = json.loads(Path(f.name).read_text())
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for path, info in report["files"].items():
        s = info["summary"]
        row = sums[package_of(path)]
        row[0] += s["covered_lines"]
        row[1] += s["num_statements"]
        row[2] += s.get("covered_branches", 0)
        row[3] += s.get("num_branches", 0)
    print(f"{'package':28s} {'lines':>13s} {'branches':>13s} {'total':>7s}")
    for pkg, (cl, nl, cb, nb) in sorted(sums.items()):
        print(f"{pkg:28s} {cl:5d}/{nl:<5d}{100 * cl / max(nl, 1):3.0f}% {cb:5d}/{nb:<5d}{100 * cb / max(nb, 1):3.0f}% "
              f"{100 * (cl + cb) / max(nl + nb, 1):6.1f}%")
    t = report["totals"]
    print(f"{'all':28s} {t['covered_lines']:5d}/{t['num_statements']:<5d}     "
          f"{t['covered_branches']:5d}/{t['num_branches']:<5d}     {t['percent_covered']:6.1f}%")
    return 0 if t["percent_covered"] >= a.fail_under else 2


if __name__ == "__main__":
    sys.exit(main())
