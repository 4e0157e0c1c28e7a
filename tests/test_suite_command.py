"""scripts/test.sh, the README's test command (issue 55): the cluster tests in a first pytest invocation on their own,
then the rest on three workers by file; an invocation that collects nothing (exit 5) is no failure. Played with a
stand-in interpreter that records each invocation's arguments and exits with the code it is given."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO

# The stand-in: records its argv as one JSON line, then exits with the next code of $EXITS (space-separated).
STAND_IN = """#!/usr/bin/env python3
import json, os, sys
calls = os.environ["CALLS"]
with open(calls, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")
n = sum(1 for _ in open(calls))
sys.exit(int(os.environ["EXITS"].split()[n - 1]))
"""


def suite(tmp_path, exits: str, *args: str) -> tuple[int, list[list[str]], str]:
    """Run scripts/test.sh with the stand-in: (exit code, each invocation's arguments, stderr)."""
    stand_in, calls = tmp_path / "python", tmp_path / "calls.jsonl"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    calls.unlink(missing_ok=True)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "test.sh"), *args], capture_output=True, text=True,
                       env={**os.environ, "HFTRAIN_TEST_PYTHON": str(stand_in), "CALLS": str(calls), "EXITS": exits},
                       timeout=60)
    invocations = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return r.returncode, invocations, r.stderr


def option(argv: list[str], name: str) -> str:
    """The value pytest takes for `name`: its last occurrence wins."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == name][-1]


def test_the_cluster_tests_run_first_on_their_own_then_the_rest_by_file_on_three_workers(tmp_path):
    rc, (cluster, rest), _ = suite(tmp_path, "0 0", "-x", "-n", "2")
    assert rc == 0
    assert cluster[:2] == ["-m", "pytest"] and option(cluster, "-m") == "cluster" and option(cluster, "-n") == "0"
    assert option(rest, "-m") == "not cluster" and option(rest, "--dist") == "loadfile"
    assert option(rest, "-n") == "2"  # the caller's -n applies to the second invocation only
    assert "-x" in cluster and "-x" in rest


@pytest.mark.parametrize("exits, expected", [("5 0", 0), ("0 5", 0), ("5 5", 5), ("1 0", 1), ("0 1", 1), ("5 2", 2)])
def test_an_invocation_that_collects_nothing_is_no_failure_and_a_failure_fails_after_both_ran(tmp_path, exits,
                                                                                               expected):
    rc, invocations, _ = suite(tmp_path, exits)
    assert (rc, len(invocations)) == (expected, 2)


@pytest.mark.parametrize("arg", [["-m", "not launches"], ["-mfast"], ["--markexpr=slow"]])
def test_a_marker_expression_is_refused_before_any_run(tmp_path, arg):
    rc, invocations, err = suite(tmp_path, "0 0", *arg)
    assert (rc, invocations) == (2, []) and "marker expression" in err
