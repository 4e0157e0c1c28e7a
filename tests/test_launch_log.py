"""tests/launch_log.py, the suite's cost accounting (issue 36), on only when asked for (issue 55): a forked launch
reports the CPU its ranks used, and the summary adds each file's CPU from the three places it is counted (the pytest
process, its reaped children, forked launches) without counting one twice."""

import json
import os
import subprocess
import sys

import pytest

from tests import forked
from tests.conftest import REPO
from tests.launch_log import ACCOUNTING_ENV, LAUNCH_LOG_ENV, accounting_asked, cpu_lines

LAUNCHES_TRUE = "import subprocess\n\n\ndef test_it():\n    subprocess.run(['true'], check=True)\n"
BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < float(sys.argv[1]): pass\n"


@pytest.mark.launches
def test_a_forked_launch_reports_its_ranks_cpu_seconds(tmp_path):
    """Two forked ranks each burn 0.5 s of CPU: the launch reports at least their 1 s (usage of the forkserver's own
    imports, before the fork, is not counted: a forked child's usage starts at zero)."""
    script = tmp_path / "burn.py"
    script.write_text(BURN)
    cmd = [sys.executable, "-m", forked.TORCHRUN_MODULE, "--nproc_per_node", "2", "--master_port", "29999",
           str(script), "0.5"]
    result = forked.launch(cmd, dict(os.environ), str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 1.0 <= result.cpu_seconds < 3.0, result.cpu_seconds


def test_the_cpu_summary_adds_each_file_once_from_where_it_was_counted():
    log = [{"kind": "test", "test": "tests/test_a.py::test_x", "self": 1.0, "children": 10.0},
           {"kind": "test", "test": "tests/test_a.py::test_y", "self": 2.0, "children": 0.0},
           {"test": "tests/test_a.py::test_y", "argv": ["[forked]"], "rc": 0, "seconds": 9.0, "cpu": 20.0},
           {"test": "tests/test_a.py::test_x", "argv": ["python"], "rc": 0, "seconds": 9.0},  # in test_x's children
           {"kind": "test", "test": "tests/test_b.py::test_z", "self": 0.5, "children": 0.0}]
    lines = cpu_lines(log)
    assert lines[0].startswith("CPU: 34 s in all")
    assert lines[1:3] == ["     22.0 s  tests/test_a.py::test_y", "     11.0 s  tests/test_a.py::test_x"]
    assert "      3.0 +    30.0 =    33.0 s  tests/test_a.py" in lines
    assert "      0.5 +     0.0 =     0.5 s  tests/test_b.py" in lines


def _pytest_in(folder, env: dict) -> tuple[subprocess.CompletedProcess, str]:
    """pytest on a one-test file in `folder` that launches `true`, with the launch log's plugin (-p): its output, and
    the log as written (empty when there is none)."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_one.py").write_text(LAUNCHES_TRUE)
    env = {k: v for k, v in os.environ.items() if k not in (ACCOUNTING_ENV, LAUNCH_LOG_ENV)} | env
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.launch_log", "-p", "no:xdist",
                        "-p", "no:cacheprovider", str(folder / "test_one.py")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    log = folder / ".pytest_launches.jsonl"
    return r, log.read_text() if log.exists() else ""


@pytest.mark.launches
def test_the_accounting_is_off_unless_asked_for_and_then_logs_each_launch_and_test(tmp_path):
    (tmp_path / "off").mkdir()
    r, log = _pytest_in(tmp_path / "off", {})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "launched processes" not in r.stdout and log == ""

    (tmp_path / "on").mkdir()
    r, log = _pytest_in(tmp_path / "on", {ACCOUNTING_ENV: "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "launched processes" in r.stdout and "1 launches" in r.stdout, r.stdout[-3000:]
    lines = [json.loads(line) for line in log.splitlines()]
    assert [x.get("kind") for x in lines] == [None, "test"] and lines[0]["argv"] == ["true"], lines


def test_an_accounting_value_other_than_0_or_1_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ACCOUNTING_ENV, "yes")
    with pytest.raises(pytest.UsageError, match=f"{ACCOUNTING_ENV}='yes'"):
        accounting_asked()
