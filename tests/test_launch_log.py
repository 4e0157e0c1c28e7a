"""tests/launch_log.py, the suite's cost accounting (issue 36): a forked launch reports the CPU its ranks used, and the
summary adds each file's CPU from the three places it is counted (the pytest process, its reaped children, forked
launches) without counting one twice."""

import os
import sys

import pytest

from tests import forked
from tests.launch_log import cpu_lines

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
