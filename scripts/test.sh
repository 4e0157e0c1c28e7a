#!/usr/bin/env bash
# The whole test suite (the README's test command and .ci/run), in two pytest invocations:
#  1. the tests marked `cluster` (network namespaces, SLURM daemons, a fresh venv), one at a time with nothing beside
#     them: test_multinode runs two or three launchers of several processes at once, and beside another worker's
#     2-rank launches they took 4x their time alone, near their own time-outs;
#  2. everything else on three pytest workers, whole files per worker (`--dist loadfile`: a module's fixtures, its
#     matrix launches and reference runs, are made once): on two cores many tests wait for a time-out or a signal,
#     and the third worker fills that time.
# DeepSpeed's CPU ops are built, or brought up to date, at nice 19 from the start, in the CPU the cluster tier leaves
# idle (a third of its time): the tests that need them wait for the build, and in the cluster tier run last
# (tests/op_build.py); the build's log is .pytest_deepspeed_ops.log.
# Extra arguments go to both invocations (-x, -k, --lf, ...); `-n` applies to the second only. A marker expression
# is refused: the two invocations are the split by marker (for one tier, call pytest: README). An invocation that
# collects no test (pytest's exit 5, e.g. under -k) is no failure, unless neither collected one.
# HFTRAIN_SUITE_ACCOUNTING=1 adds the launch log and CPU summary (tests/launch_log.py) to each invocation; the
# cluster one writes its log to .pytest_launches.cluster.jsonl.
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
    "$PYTHON" -m pytest -q -rs --durations=30 "$@" -n 0 -m cluster
cluster=$?
# Finished before the second tier: on three busy workers a build at nice 19 would starve while they waited on it.
wait "$HFTRAIN_OPS_BUILD_PID" 2>/dev/null
grep -h "setup: DeepSpeed op\|setup: removed" "$HFTRAIN_OPS_BUILD_LOG" || true
"$PYTHON" -m pytest -q -rs --durations=30 -n 3 --dist loadfile "$@" -m "not cluster"
rest=$?

if [ "$cluster" -eq 5 ] && [ "$rest" -eq 5 ]; then
    exit 5  # nothing collected at all
fi
for rc in "$cluster" "$rest"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
