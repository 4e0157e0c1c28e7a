"""Measure the exactness bounds' spread: run the tests that use a bound (tests/exactness.py) under each CPU path this
machine has (ATEN_CPU_CAPABILITY), collect every error they judged, and print per bound its limit, the largest error
seen on each path and the smallest control error, with a verdict by tests/exactness.py's rule.

    .venv/bin/python scripts/exactness_spread.py                 # every capability this CPU has, all bound users
    .venv/bin/python scripts/exactness_spread.py --capabilities avx2 -- tests/test_moe.py -k zero3
    .venv/bin/python scripts/exactness_spread.py --table spread.jsonl   # tabulate a log already written

What it prints is what goes into BOUNDS[...].seen. A failing test is reported (its errors are still in the log).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.exactness import BOUNDS, FLOOR, MARGIN, RECORD_ONLY, SPREAD_LOG  # noqa: E402

ORDER = ("avx512", "avx2", "default")  # widest first; ATen can go down from the CPU's own, never up


def capabilities_here() -> list[str]:
    """The CPU paths ATen can take on this machine: its own and every narrower one."""
    import torch

    own = torch.backends.cpu.get_cpu_capability().lower()
    return list(ORDER[ORDER.index(own):]) if own in ORDER else [own]


def users_of_bounds() -> list[str]:
    tests = os.path.join(REPO, "tests")
    return sorted(os.path.join("tests", f) for f in os.listdir(tests)
                  if f.startswith("test_") and f.endswith(".py") and f != "test_exactness.py"
                  and "exactness import" in open(os.path.join(tests, f), encoding="utf-8").read())


def run(capability: str, log: str, pytest_args: list[str], workers: int, record_only: bool) -> int:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, **{SPREAD_LOG: log},
               **({RECORD_ONLY: "1"} if record_only else {}))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers), "--dist", "loadfile",
           *(pytest_args or users_of_bounds())]
    print(f"exactness_spread: ATEN_CPU_CAPABILITY={capability}: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def table(log: str) -> str:
    seen: dict[str, dict[str, float]] = collections.defaultdict(dict)
    controls: dict[str, float] = {}
    with open(log, encoding="utf-8") as fh:
        for line in fh:
            e = json.loads(line)
            if e["control"]:
                controls[e["bound"]] = min(controls.get(e["bound"], float("inf")), e["error"])
            else:
                by = seen[e["bound"]]
                by[e["capability"]] = max(by.get(e["capability"], 0.0), e["error"])
    rows = [f"{'bound':48} {'limit':>8} " + " ".join(f"{c:>9}" for c in ORDER) + f" {'control':>9}  verdict"]
    for name in sorted(set(seen) | set(controls)):
        limit = BOUNDS[name].limit if name in BOUNDS else float("nan")
        worst = max(seen.get(name, {}).values(), default=0.0)
        verdict = ("ok" if limit >= max(MARGIN * worst, FLOOR) and controls.get(name, float("inf")) > limit
                   else "RULE")
        cells = " ".join(f"{seen[name][c]:9.2e}" if c in seen.get(name, {}) else f"{'-':>9}" for c in ORDER)
        control = f"{controls[name]:9.2e}" if name in controls else f"{'-':>9}"
        rows.append(f"{name:48} {limit:8.0e} {cells} {control}  {verdict}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--capabilities", nargs="+", default=None, help="default: every one this CPU has")
    ap.add_argument("--log", default=os.path.join(REPO, ".exactness_spread.jsonl"))
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--table", metavar="LOG", help="only tabulate this log")
    ap.add_argument("--record-only", action="store_true", help="record the errors without judging them (a bound "
                    "not yet in BOUNDS, or one being re-measured)")
    ap.add_argument("pytest_args", nargs="*", help="after --: tests and options for pytest (default: every user)")
    ns = ap.parse_args(argv)
    if ns.table:
        print(table(ns.table))
        return 0
    if os.path.exists(ns.log):
        os.remove(ns.log)
    failed = [c for c in ns.capabilities or capabilities_here()
              if run(c, ns.log, ns.pytest_args, ns.workers, ns.record_only) != 0]
    print(table(ns.log))
    if failed:
        print(f"exactness_spread: tests failed under {', '.join(failed)} (their errors are in the table)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
