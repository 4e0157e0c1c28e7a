"""tests/op_build.py: the suite's waiting for a background build of DeepSpeed's ops, and the order that runs the tests
needing them last (scripts/test.sh starts the build; tests/test_suite_command.py plays that part)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from tests import op_build


def test_a_running_build_is_waited_for_and_an_ended_one_is_not():
    """Judged against the wait's own limit (60 s), never against the machine's speed: a build running 1.5 s is waited
    for until it ends, an ended one not at all."""
    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    environ = {op_build.OP_BUILD_PID: str(build.pid)}
    assert op_build.background_build_started(environ) and op_build.background_build_running(environ)
    waited = op_build.wait_for_background_build(environ, limit_s=60, poll_s=0.1)
    assert 1.0 <= waited < 60 and not op_build.background_build_running(environ)
    build.wait()
    assert op_build.wait_for_background_build(environ, limit_s=60, poll_s=0.1) < 30


def test_an_ended_build_not_yet_reaped_is_not_running():
    build = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, build.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie, which still answers kill(0)
    environ = {op_build.OP_BUILD_PID: str(build.pid)}
    assert not op_build.background_build_running(environ)
    build.wait()


def test_no_build_started_means_nothing_to_wait_for():
    assert not op_build.background_build_started({}) and not op_build.background_build_running({})
    assert op_build.wait_for_background_build({}, limit_s=60) < 30


def test_tests_needing_the_ops_go_last_in_their_order():
    def item(name, fixtures=(), **params):
        return SimpleNamespace(name=name, fixturenames=["tmp_path", *fixtures],
                               **({"callspec": SimpleNamespace(params=params)} if params else {}))

    items = [item("multinode[ddp]", strategy="ddp"), item("multinode[zero3]", strategy="zero3"),
             item("multinode_dies[frozen]", how="frozen"), item("slurm_time_limit"),
             item("slurm_scancel", ["deepspeed_ops"]), item("wheel")]
    ordered = [i.name for i in op_build.tests_needing_ops_last(items)]
    assert ordered == ["multinode[ddp]", "multinode_dies[frozen]", "slurm_time_limit", "wheel", "multinode[zero3]",
                       "slurm_scancel"]


def test_the_failure_message_ends_with_the_builds_log(tmp_path):
    log = tmp_path / "ops.log"
    log.write_text("setup: DeepSpeed op async_io (4/4): building ... error: libaio.h: No such file")
    assert "libaio.h" in op_build.build_log_tail({op_build.OP_BUILD_LOG: str(log)})
    assert op_build.build_log_tail({}) == ""
