"""scripts/test.sh, the README's test command (issue 55): the cluster tests that need the machine alone in a pytest
invocation of their own, then the rest on three workers by file with the cluster tests that mostly wait beside them;
an invocation that collects nothing (exit 5) is no failure; DeepSpeed's ops are built, or brought up to date, beside
the first invocation and over before the others (tests/op_build.py). Played with a stand-in interpreter that records
each call (arguments, the build's exported process id, its niceness, when it started and ended) and exits as told:
the first invocation with the first code of $EXITS, the one on three workers with the second, the one beside it with
the third."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO

# The stand-in. The op script (the build) sleeps $BUILD_S. A pytest invocation exits with
# the next code of $EXITS (space-separated) and records whether the build it was handed still ran.
STAND_IN = """#!/usr/bin/env python3
import json, os, sys, time
calls, args = os.environ["CALLS"], sys.argv[1:]
build_pid = os.environ.get("HFTRAIN_OPS_BUILD_PID")
def running(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
record = {"argv": args, "pid": os.getpid(), "nice": os.nice(0), "build_pid": build_pid,
          "build_running": bool(build_pid) and running(build_pid), "start": time.time()}
if args[0].endswith("build_deepspeed_ops.py"):
    time.sleep(float(os.environ["BUILD_S"]))
    code = 0
else:
    marks = args[args.index("-m", 2) + 1]
    print(f"pytest -m '{marks}' ran", flush=True)
    time.sleep(float(os.environ["PYTEST_S"]))
    code = int(os.environ["EXITS"].split()[{"cluster and not mostly_waits": 0, "not cluster": 1}.get(marks, 2)])
record["end"] = time.time()
with open(calls, "a") as fh:
    fh.write(json.dumps(record) + "\\n")
sys.exit(code)
"""


def suite(tmp_path, exits: str, *args: str, build_s: float = 0, pytest_s: float = 0) -> tuple[int, list[dict], str]:
    """Run scripts/test.sh with the stand-in: (exit code, each call's record in order, its output)."""
    stand_in, calls = tmp_path / "python", tmp_path / "calls.jsonl"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    calls.unlink(missing_ok=True)
    env = {**os.environ, "HFTRAIN_TEST_PYTHON": str(stand_in), "CALLS": str(calls), "EXITS": exits,
           "BUILD_S": str(build_s), "PYTEST_S": str(pytest_s), "HFTRAIN_OPS_BUILD_LOG": str(tmp_path / "ops.log"),
           "HFTRAIN_BESIDE_LOG": str(tmp_path / "beside.log")}
    env.pop("HFTRAIN_OPS_BUILD_PID", None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "test.sh"), *args], capture_output=True, text=True,
                       env=env, timeout=60)
    records = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return r.returncode, records, r.stdout + r.stderr


def pytest_calls(records: list[dict]) -> dict[str, dict]:
    """Each pytest invocation's record by its marker expression."""
    return {option(r["argv"], "-m"): r for r in records if r["argv"][:2] == ["-m", "pytest"]}


def option(argv: list[str], name: str) -> str:
    """The value pytest takes for `name`: its last occurrence wins."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == name][-1]


ALONE, REST, BESIDE = "cluster and not mostly_waits", "not cluster", "cluster and mostly_waits"


def test_the_cluster_tests_run_first_on_their_own_then_the_rest_by_file_on_three_workers_beside_the_waiting_ones(
        tmp_path):
    rc, records, _ = suite(tmp_path, "0 0 0", "-x", "-n", "2", pytest_s=1)
    calls = pytest_calls(records)
    alone, rest, beside = calls[ALONE], calls[REST], calls[BESIDE]
    assert rc == 0 and len(calls) == 3
    assert option(alone["argv"], "-n") == "0" and option(beside["argv"], "-n") == "0"
    assert option(rest["argv"], "--dist") == "loadfile"
    assert option(rest["argv"], "-n") == "2"  # the caller's -n applies to the tier on workers only
    assert all("-x" in c["argv"] for c in calls.values())
    assert alone["end"] <= min(rest["start"], beside["start"])  # nothing beside the first
    assert beside["start"] < rest["end"] and rest["start"] < beside["end"]  # the waiting ones beside the rest


@pytest.mark.parametrize("exits, expected", [("5 0 0", 0), ("0 5 5", 0), ("5 5 5", 5), ("1 0 0", 1), ("0 1 0", 1),
                                             ("0 0 3", 3), ("5 2 5", 2)])
def test_an_invocation_that_collects_nothing_is_no_failure_and_a_failure_fails_after_all_ran(tmp_path, exits,
                                                                                             expected):
    rc, records, _ = suite(tmp_path, exits)
    assert (rc, len(pytest_calls(records))) == (expected, 3)


def test_the_waiting_tests_output_is_printed_after_the_rest(tmp_path):
    rc, _, out = suite(tmp_path, "0 0 0", pytest_s=0.5)
    rest_said, beside_said = out.index("pytest -m 'not cluster' ran"), out.index("pytest -m 'cluster and mostly_waits'")
    assert rc == 0 and rest_said < out.index("the cluster tests that mostly wait") < beside_said


@pytest.mark.parametrize("arg", [["-m", "not launches"], ["-mfast"], ["--markexpr=slow"]])
def test_a_marker_expression_is_refused_before_any_run(tmp_path, arg):
    rc, records, err = suite(tmp_path, "0 0 0", *arg)
    assert (rc, records) == (2, []) and "marker expression" in err


def test_the_ops_are_built_at_nice_19_beside_the_first_cluster_tests_and_over_before_the_others(tmp_path):
    """Always, even where every op's `.so` is in the cache: ninja says whether it is current (a fresh venv at the same
    path makes it stale), and a stale op would otherwise be rebuilt inside a test's time-out."""
    rc, records, _ = suite(tmp_path, "0 0 0", build_s=2)
    (build,) = [r for r in records if r["argv"][0] == "scripts/build_deepspeed_ops.py"]
    calls = pytest_calls(records)
    assert rc == 0 and build["argv"] == ["scripts/build_deepspeed_ops.py"] and build["nice"] == 19
    assert {c["build_pid"] for c in calls.values()} == {str(build["pid"])}  # what conftest.py waits for
    assert calls[ALONE]["build_running"] and not calls[REST]["build_running"] and not calls[BESIDE]["build_running"]
