"""DeepSpeed's CPU ops built beside the tests rather than before them (scripts/test.sh, when scripts/setup.sh was told
HFTRAIN_SETUP_DEFER_OPS=1, as .ci/run and the README's test command do).

The build takes minutes of compiling on 2 cores (7 min 30 s on the slower machine kind, most of it async_io) while
the suite, waiting on time-outs and signals much of its time, leaves about one core idle: scripts/test.sh starts
the build at nice 19 (it takes only the CPU the tests leave: the cluster tier, run first, is idle about a third of its
time, waiting on SLURM's time-limit pass and on rank time-outs), exports its process id as HFTRAIN_OPS_BUILD_PID,
and the tests that need the ops wait for it (`deepspeed_ops` in conftest.py) rather than failing; in the cluster tier
they run last, so the others use the time. No library does this for a test suite."""

from __future__ import annotations

import os
import time

OP_BUILD_PID = "HFTRAIN_OPS_BUILD_PID"
OP_BUILD_LOG = "HFTRAIN_OPS_BUILD_LOG"
# The build's own worst case on the slower machine kind with the cores shared, with room.
WAIT_LIMIT_S = 40 * 60


def background_build_started(environ=os.environ) -> bool:
    """Whether scripts/test.sh started a background build for this session."""
    return bool(environ.get(OP_BUILD_PID))


def background_build_running(environ=os.environ) -> bool:
    """Whether the build scripts/test.sh started is still running (its process id in OP_BUILD_PID)."""
    pid = environ.get(OP_BUILD_PID)
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, PermissionError, ValueError):  # gone, or a reused id of someone else's
        return False
    return _not_a_zombie(int(pid))


def _not_a_zombie(pid: int) -> bool:
    """An ended child of a shell not yet reaped still answers kill(0): its state in /proc says whether it ended."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: trust kill(0)


def wait_for_background_build(environ=os.environ, limit_s: float = WAIT_LIMIT_S, poll_s: float = 2.0) -> float:
    """Block until the background build has ended (or `limit_s` passed); the seconds waited."""
    t0 = time.monotonic()
    while background_build_running(environ) and time.monotonic() - t0 < limit_s:
        time.sleep(poll_s)
    return time.monotonic() - t0


def build_log_tail(environ=os.environ, chars: int = 2000) -> str:
    """The end of the background build's log, for a failure message ('' when there is none)."""
    path = environ.get(OP_BUILD_LOG)
    if not path or not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return f"\nthe build's log ({path}) ends:\n{fh.read()[-chars:]}"


def needs_ops(item) -> bool:
    """A test that launches a DeepSpeed run: it asks for the ops, or is parametrised with a ZeRO strategy (the
    fixtures it uses then ask for them)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "deepspeed_ops" in item.fixturenames or any(
        isinstance(value, str) and value.startswith("zero") for value in params.values())


def tests_needing_ops_last(items: list) -> list:
    """`items` with the tests that need the ops moved after the others, each group in its order. For the cluster
    tier only (one process, one test at a time): under pytest-xdist the tests that need the ops are most of the
    2-rank launches, and run together at the end on three workers they took 3-5x their time (measured, 2026-11-28)."""
    return sorted(items, key=needs_ops)  # sorted() is stable: the order within each group is kept
