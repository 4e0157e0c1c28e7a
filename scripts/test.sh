#!/usr/bin/env bash
# The whole test suite (the README's test command and .ci/run), in three pytest invocations:
#  1. the tests marked `cluster` but not `mostly_waits` (network namespaces, a fresh venv), one at a time with nothing
#     beside them: test_multinode runs two or three launchers of several processes at once, and beside another
#     worker's 2-rank launches they took 4x their time alone, near their own time-outs;
#  2. everything not marked `cluster` on three pytest workers, whole files per worker (`--dist loadfile`: a module's
#     fixtures, its matrix launches and reference runs, are made once): on two cores many tests wait for a time-out
#     or a signal, and the third worker fills that time;
#  3. beside 2, in one process of its own, the cluster tests marked `mostly_waits` (SLURM's daemons: a job's steps
#     sleep, slurmctld passes every 30 s): alone they left the cores 70-100% idle for about 3 minutes. Its output is
#     printed after the second invocation's (.pytest_beside.log).
# DeepSpeed's CPU ops are built, or brought up to date, at nice 19 from the start, in the CPU the first invocation
# leaves idle: the tests that need them wait for the build, and in that invocation run last (tests/op_build.py); the
# build's log is .pytest_deepspeed_ops.log. It is over before 2 and 3 start.
# Extra arguments go to every invocation (-x, -k, --lf, ...); `-n` applies to the second only. A marker expression
# is refused: the invocations are the split by marker (for one tier, call pytest: README). An invocation that
# collects no test (pytest's exit 5, e.g. under -k) is no failure, unless none collected one.
# HFTRAIN_SUITE_ACCOUNTING=1 adds the launch log and CPU summary (tests/launch_log.py) to each invocation; the
# cluster ones write their logs to .pytest_launches.cluster.jsonl and .pytest_launches.beside.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${HFTRAIN_TEST_PYTHON:-.venv/bin/python}"

for arg in "$@"; do
    case "$arg" in
        -m|-m*|--markexpr|--markexpr=*)
            echo "scripts/test.sh: a marker expression ($arg) is refused: the script runs '-m cluster', then" \
                 "'-m \"not cluster\"'; for one tier run pytest itself (README)" >&2
            exit 2 ;;
    esac
done

# Always: ninja, not the presence of a `.so`, says whether an op is current (a CI's fresh venv at the same path makes
# every cached op stale); an op that is current loads in seconds.
export HFTRAIN_OPS_BUILD_LOG="${HFTRAIN_OPS_BUILD_LOG:-$PWD/.pytest_deepspeed_ops.log}"
echo "scripts/test.sh: building DeepSpeed's ops, or loading them where current, beside the tests (nice 19; log:" \
     "$HFTRAIN_OPS_BUILD_LOG)"
nice -n 19 "$PYTHON" scripts/build_deepspeed_ops.py > "$HFTRAIN_OPS_BUILD_LOG" 2>&1 &
export HFTRAIN_OPS_BUILD_PID=$!
trap 'kill "$HFTRAIN_OPS_BUILD_PID" 2>/dev/null || true' EXIT  # an interrupted suite leaves no build behind

HFTRAIN_LAUNCH_LOG="$PWD/.pytest_launches.cluster.jsonl" \
    "$PYTHON" -m pytest -q -rs --durations=30 "$@" -n 0 -m "cluster and not mostly_waits"
alone=$?
# Finished before the second tier: on three busy workers a build at nice 19 would starve while they waited on it.
wait "$HFTRAIN_OPS_BUILD_PID" 2>/dev/null
grep -h "setup: DeepSpeed op\|setup: removed" "$HFTRAIN_OPS_BUILD_LOG" || true

BESIDE_LOG="${HFTRAIN_BESIDE_LOG:-$PWD/.pytest_beside.log}"
HFTRAIN_LAUNCH_LOG="$PWD/.pytest_launches.beside.jsonl" \
    "$PYTHON" -m pytest -q -rs --durations=30 "$@" -n 0 -m "cluster and mostly_waits" > "$BESIDE_LOG" 2>&1 &
beside_pid=$!
trap 'kill "$HFTRAIN_OPS_BUILD_PID" "$beside_pid" 2>/dev/null || true' EXIT  # an interrupted suite leaves neither
"$PYTHON" -m pytest -q -rs --durations=30 -n 3 --dist loadfile "$@" -m "not cluster"
rest=$?
wait "$beside_pid"
beside=$?
echo "scripts/test.sh: the cluster tests that mostly wait, run beside the rest ($BESIDE_LOG):"
cat "$BESIDE_LOG"

if [ "$alone" -eq 5 ] && [ "$rest" -eq 5 ] && [ "$beside" -eq 5 ]; then
    exit 5  # nothing collected at all
fi
for rc in "$alone" "$rest" "$beside"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
