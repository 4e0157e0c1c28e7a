"""tests/op_build.py: the suite's waiting for a background build of DeepSpeed's ops, and the order that runs the files
needing them last (scripts/test.sh starts the build; tests/test_suite_command.py plays that part)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tests import op_build


def test_a_running_build_is_waited_for_and_an_ended_one_is_not():
    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    environ = {op_build.OP_BUILD_PID: str(build.pid)}
    assert op_build.background_build_started(environ) and op_build.background_build_running(environ)
    waited = op_build.wait_for_background_build(environ, poll_s=0.1)
    assert 1.0 <= waited < 10 and not op_build.background_build_running(environ)
    build.wait()
    assert op_build.wait_for_background_build(environ, poll_s=0.1) < 0.5


def test_an_ended_build_not_yet_reaped_is_not_running():
    build = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.0)  # ended, not reaped: a zombie, which still answers kill(0)
    environ = {op_build.OP_BUILD_PID: str(build.pid)}
    assert not op_build.background_build_running(environ)
    build.wait()


def test_no_build_started_means_nothing_to_wait_for():
    assert not op_build.background_build_started({}) and not op_build.background_build_running({})
    assert op_build.wait_for_background_build({}, limit_s=5) < 0.5


def test_files_needing_the_ops_go_last_whole_and_in_order():
    sources = {"a.py": "def test(deepspeed_ops): ...", "b.py": "def test(): ...",
               "c.py": "def test(reference_runs): ...", "d.py": "def test(tmp_path): ..."}
    items = [SimpleNamespace(path=Path(f), name=f"{f}::{i}") for f in sources for i in range(2)]
    ordered = [item.name for item in op_build.files_needing_ops_last(items, lambda path: sources[path])]
    assert ordered == ["b.py::0", "b.py::1", "d.py::0", "d.py::1", "a.py::0", "a.py::1", "c.py::0", "c.py::1"]


def test_the_failure_message_ends_with_the_builds_log(tmp_path):
    log = tmp_path / "ops.log"
    log.write_text("setup: DeepSpeed op async_io (4/4): building ... error: libaio.h: No such file")
    assert "libaio.h" in op_build.build_log_tail({op_build.OP_BUILD_LOG: str(log)})
    assert op_build.build_log_tail({}) == ""
