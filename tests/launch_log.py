"""The suite's cost, made visible when asked for (HFTRAIN_SUITE_ACCOUNTING=1; off by default): every process a test
launches is recorded as one JSON line (test id, argv, seconds) in LAUNCH_LOG, and the end of the session prints a
summary of it beside pytest's own durations (the most expensive launches, launches and seconds per file, the total).

Wall seconds hide what the suite is short of: on 2 cores it is CPU-bound (a launch that waits for a time-out costs
little, one that imports torch in three processes a lot). So each test also writes its CPU seconds: the pytest
process's own, and its reaped child processes' (`resource.RUSAGE_CHILDREN`: a launched process and the processes it
waited for); a launch forked from tests/forked.py's server (not a child of the pytest process) reports its own and
its ranks' in its line. The summary names the tests and files that use the most CPU.

A pytest plugin (conftest.py's pytest_configure registers `Accounting` when asked): `subprocess.Popen` is replaced,
in the pytest process(es) running tests (not in xdist's controller, whose processes are the workers), by a
subclass that writes its line when the process is first seen ended (wait, poll, communicate and subprocess.run all
go through `wait` or `poll`). Launches made by the launched processes themselves are part of their parent's time.
Under pytest-xdist every worker appends to the same file (one short write per line, O_APPEND); the controller
empties it at the start and reads it at the end."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from collections import defaultdict

import pytest

from tests.support import cpu_seconds

LAUNCH_LOG_ENV = "HFTRAIN_LAUNCH_LOG"
ACCOUNTING_ENV = "HFTRAIN_SUITE_ACCOUNTING"  # "1": the accounting is on (off by default)
TOP = 15
TIER_MARKERS = ("launches", "cluster")  # the fast tier is `-m "not launches and not cluster"`
UNMARKED_LIMIT_S = 2.0  # a launch longer than this by an unmarked test is named in the summary (it slows that tier)
_current = {"marked": True}  # whether the running test carries one of TIER_MARKERS


def _current_test() -> str:
    # PYTEST_CURRENT_TEST is "tests/test_x.py::test_y[param] (call)"; set-up counts for the test that needs it.
    return os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)").rsplit(" (", 1)[0]


def _argv(args) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return [os.fsdecode(args)]
    return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


class RecordedPopen(subprocess.Popen):
    log_path: str | None = None

    def __init__(self, args, *rest, **kwargs):
        self._launch = started(args)
        super().__init__(args, *rest, **kwargs)

    def _record_end(self) -> None:
        launch, self._launch = getattr(self, "_launch", None), None
        if launch is None or self.returncode is None:
            return
        record(launch, self.returncode)

    def wait(self, timeout=None):
        rc = super().wait(timeout)
        self._record_end()
        return rc

    def poll(self):
        rc = super().poll()
        if rc is not None:
            self._record_end()
        return rc


def started(argv) -> dict:
    """A launch's record as it starts: hand it to `record` when it ends (tests/forked.py's launches, which are no
    Popen, use the pair directly)."""
    return {"test": _current_test(), "argv": _argv(argv), "start": time.monotonic(), "marked": _current["marked"]}


def record(launch: dict, returncode: int, cpu: float | None = None) -> None:
    """`cpu`: the CPU seconds of a launch that is not a child of the pytest process (a forked one)."""
    line = {"test": launch["test"], "argv": launch["argv"], "rc": returncode, "marked": launch["marked"],
            "seconds": round(time.monotonic() - launch["start"], 3)}
    if cpu is not None:
        line["cpu"] = round(cpu, 3)
    _write(line)


def _write(line: dict) -> None:
    if not RecordedPopen.log_path:
        return
    with open(RecordedPopen.log_path, "a") as fh:
        fh.write(json.dumps(line) + "\n")


def read_log(path: str) -> list[dict]:
    """Every line of the log: launches, and each test's CPU ("kind": "test")."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def short_argv(argv: list[str], width: int = 110) -> str:
    text = " ".join(os.path.basename(a) if os.path.isabs(a) else a for a in argv)
    return text if len(text) <= width else text[:width - 3] + "..."


def summary_lines(log: list[dict]) -> list[str]:
    """The summary CI prints: the TOP most expensive launches, launches and seconds per file, the total; then CPU."""
    launches = [x for x in log if x.get("kind") != "test"]
    return launch_lines(launches) + cpu_lines(log)


def launch_lines(launches: list[dict]) -> list[str]:
    if not launches:
        return ["no process was launched"]
    total = sum(x["seconds"] for x in launches)
    lines = [f"{len(launches)} launches, {total:.0f} s of launch time in all (wall time per launch, summed)",
             f"the {min(TOP, len(launches))} most expensive:"]
    for x in sorted(launches, key=lambda x: -x["seconds"])[:TOP]:
        lines.append(f"  {x['seconds']:7.1f} s  {x['test']}  ::  {short_argv(x['argv'])}")
    per_file: dict[str, list[float]] = defaultdict(list)
    for x in launches:
        per_file[x["test"].split("::")[0]].append(x["seconds"])
    lines.append("per file (launches, seconds):")
    for name, secs in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {len(secs):4d} {sum(secs):8.1f} s  {name}")
    unmarked = sorted({x["test"] for x in launches if not x.get("marked", True) and x["seconds"] > UNMARKED_LIMIT_S})
    if unmarked:
        lines.append(f"tests that launch processes of over {UNMARKED_LIMIT_S:.0f} s without a marker of "
                     f"{' or '.join(TIER_MARKERS)} (they slow the fast tier: mark them):")
        lines.extend(f"  {t}" for t in unmarked)
    return lines


def cpu_lines(log: list[dict]) -> list[str]:
    """CPU seconds per test and per file: the pytest process's own, its launches' (reaped children and forked)."""
    tests = [x for x in log if x.get("kind") == "test"]
    if not tests:
        return []
    per_test: dict[str, float] = defaultdict(float)
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for x in tests:
        per_test[x["test"]] += x["self"] + x["children"]
        own_and_launched = per_file[x["test"].split("::")[0]]
        own_and_launched[0] += x["self"]
        own_and_launched[1] += x["children"]
    for x in log:
        if "cpu" in x:  # a forked launch, no child of the pytest process
            per_test[x["test"]] += x["cpu"]
            per_file[x["test"].split("::")[0]][1] += x["cpu"]
    total = sum(sum(v) for v in per_file.values())
    lines = [f"CPU: {total:.0f} s in all (pytest processes and every process they launched); the "
             f"{min(TOP, len(per_test))} tests that used the most:"]
    lines += [f"  {cpu:7.1f} s  {test}" for test, cpu in sorted(per_test.items(), key=lambda kv: -kv[1])[:TOP]]
    lines.append("CPU per file (in the pytest process + in launched processes = total):")
    for name, (own, launched) in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {own:7.1f} + {launched:7.1f} = {own + launched:7.1f} s  {name}")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# pytest hooks: off unless asked for


def accounting_asked() -> bool:
    """HFTRAIN_SUITE_ACCOUNTING=1 turns the accounting on; unset, empty or 0 leaves it off."""
    value = os.environ.get(ACCOUNTING_ENV, "")
    if value not in ("", "0", "1"):
        raise pytest.UsageError(f"{ACCOUNTING_ENV}={value!r}: set it to 1 for the suite's launch log and CPU "
                                "summary, or leave it unset (0) for none")
    return value == "1"


def pytest_configure(config):
    """conftest.py's hook: registers the accounting (Accounting) only when it is asked for."""
    if accounting_asked():
        config.pluginmanager.register(Accounting(config), "hftrain-suite-accounting")


class Accounting:
    """The launch log's pytest plugin: every launch recorded, each test's CPU seconds, the summary at the end."""

    def __init__(self, config):
        path = os.environ.get(LAUNCH_LOG_ENV) or os.path.join(str(config.rootpath), ".pytest_launches.jsonl")
        if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) starts the log afresh
            os.environ[LAUNCH_LOG_ENV] = path  # inherited by xdist's workers
            with open(path, "w"):
                pass
        RecordedPopen.log_path = path
        self.popen = subprocess.Popen
        if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
            subprocess.Popen = RecordedPopen  # not in xdist's controller: the processes it starts are the workers

    def pytest_unconfigure(self, config):
        subprocess.Popen, RecordedPopen.log_path = self.popen, None

    def pytest_runtest_setup(self, item):
        _current["marked"] = any(item.get_closest_marker(m) for m in TIER_MARKERS)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        """The test's CPU seconds (set-up, call and tear-down): this process's and its reaped children's; the worker
        that ran it and when it ended (the suite's timeline: which files ran beside which)."""
        own, children = cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_CHILDREN)
        try:
            return (yield)
        finally:
            _write({"kind": "test", "test": item.nodeid, "self": round(cpu_seconds(resource.RUSAGE_SELF) - own, 3),
                    "children": round(cpu_seconds(resource.RUSAGE_CHILDREN) - children, 3),
                    "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "ended": round(time.time(), 1)})

    def pytest_terminal_summary(self, terminalreporter, config):
        if hasattr(config, "workerinput"):
            return
        terminalreporter.section(f"launched processes ({RecordedPopen.log_path})")
        for line in summary_lines(read_log(RecordedPopen.log_path)):
            terminalreporter.write_line(line)
