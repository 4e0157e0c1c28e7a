"""scripts/test.sh, the README's test command (issue 55): the cluster tests in a pytest invocation of their own, then
the rest on three workers by file; an invocation that collects nothing (exit 5) is no failure; DeepSpeed's ops are
built, or brought up to date, beside the first invocation and over before the second (tests/op_build.py). Played with
a stand-in interpreter that records each call (arguments, the build's exported process id, its niceness) and exits as
told."""

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
          "build_running": bool(build_pid) and running(build_pid)}
with open(calls, "a") as fh:
    fh.write(json.dumps(record) + "\\n")
if args[0].endswith("build_deepspeed_ops.py"):
    time.sleep(float(os.environ["BUILD_S"]))
    sys.exit(0)
n = sum(1 for line in open(calls) if json.loads(line)["argv"][:2] == ["-m", "pytest"])
sys.exit(int(os.environ["EXITS"].split()[n - 1]))
"""


def suite(tmp_path, exits: str, *args: str, build_s: float = 0) -> tuple[int, list[dict], str]:
    """Run scripts/test.sh with the stand-in: (exit code, each call's record in order, stderr)."""
    stand_in, calls = tmp_path / "python", tmp_path / "calls.jsonl"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    calls.unlink(missing_ok=True)
    env = {**os.environ, "HFTRAIN_TEST_PYTHON": str(stand_in), "CALLS": str(calls), "EXITS": exits,
           "BUILD_S": str(build_s), "HFTRAIN_OPS_BUILD_LOG": str(tmp_path / "ops.log")}
    env.pop("HFTRAIN_OPS_BUILD_PID", None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "test.sh"), *args], capture_output=True, text=True,
                       env=env, timeout=60)
    records = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return r.returncode, records, r.stderr


def pytest_calls(records: list[dict]) -> list[list[str]]:
    return [r["argv"] for r in records if r["argv"][:2] == ["-m", "pytest"]]


def option(argv: list[str], name: str) -> str:
    """The value pytest takes for `name`: its last occurrence wins."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == name][-1]


def test_the_cluster_tests_run_first_on_their_own_then_the_rest_by_file_on_three_workers(tmp_path):
    rc, records, _ = suite(tmp_path, "0 0", "-x", "-n", "2")
    cluster, rest = pytest_calls(records)
    assert rc == 0
    assert cluster[:2] == ["-m", "pytest"] and option(cluster, "-m") == "cluster" and option(cluster, "-n") == "0"
    assert option(rest, "-m") == "not cluster" and option(rest, "--dist") == "loadfile"
    assert option(rest, "-n") == "2"  # the caller's -n applies to the second invocation only
    assert "-x" in cluster and "-x" in rest


@pytest.mark.parametrize("exits, expected", [("5 0", 0), ("0 5", 0), ("5 5", 5), ("1 0", 1), ("0 1", 1), ("5 2", 2)])
def test_an_invocation_that_collects_nothing_is_no_failure_and_a_failure_fails_after_both_ran(tmp_path, exits,
                                                                                               expected):
    rc, records, _ = suite(tmp_path, exits)
    assert (rc, len(pytest_calls(records))) == (expected, 2)


@pytest.mark.parametrize("arg", [["-m", "not launches"], ["-mfast"], ["--markexpr=slow"]])
def test_a_marker_expression_is_refused_before_any_run(tmp_path, arg):
    rc, records, err = suite(tmp_path, "0 0", *arg)
    assert (rc, records) == (2, []) and "marker expression" in err


def test_the_ops_are_built_at_nice_19_beside_the_cluster_tests_and_over_before_the_rest(tmp_path):
    """Always, even where every op's `.so` is in the cache: ninja says whether it is current (a fresh venv at the same
    path makes it stale), and a stale op would otherwise be rebuilt inside a test's time-out."""
    rc, records, _ = suite(tmp_path, "0 0", build_s=2)
    (build,) = [r for r in records if r["argv"][0] == "scripts/build_deepspeed_ops.py"]
    cluster, rest = [r for r in records if r["argv"][:2] == ["-m", "pytest"]]
    assert rc == 0 and build["argv"] == ["scripts/build_deepspeed_ops.py"] and build["nice"] == 19
    assert cluster["build_pid"] == rest["build_pid"] == str(build["pid"])  # what conftest.py waits for
    assert cluster["build_running"] and not rest["build_running"]
