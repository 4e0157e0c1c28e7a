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


class _Config:
    """What xdist's scope scheduler reads of pytest's config: three workers."""

    option = type("Option", (), {"loadscopereorder": True})()

    def getvalue(self, name):
        return ["3*popen"] if name == "tx" else None


class _Node:
    def __init__(self, name):
        self.name, self.shutting_down, self.sent = name, False, []
        self.gateway = type("Gateway", (), {"id": name})()

    def send_runtest_some(self, indexes):
        self.sent.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


def test_the_cluster_unit_runs_first_and_alone_then_the_heaviest_first():
    """The scheduler on three simulated workers: test_multinode starts first and nothing starts beside it (the other
    workers wait); once it is done the heaviest modules go first (tests/scheduling.WEIGHTS_S)."""
    from tests.scheduling import make_scheduler

    collection = [f"tests/{module}.py::t{i}" for module in ("test_recipe", "test_multinode", "test_templates",
                                                             "test_resume", "test_slurm") for i in range(4)]
    sched, nodes = make_scheduler(_Config(), None), [_Node(f"gw{i}") for i in range(3)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()

    def units(node, done=()):
        return [collection[i].split("::")[0][6:-3] for i in node.sent if collection[i] not in done]

    assert set(units(nodes[0])) <= {"test_multinode", "test_slurm"} and units(nodes[0])[0] == "test_multinode"
    assert units(nodes[1]) == units(nodes[2]) == []  # nothing beside it, not even a module that launches nothing
    cluster = [i for i in nodes[0].sent if "multinode" in collection[i]]
    for i in cluster:
        sched.mark_test_complete(nodes[0], i)
    done = {collection[i] for i in cluster}
    started = [units(node, done)[:1] for node in nodes]
    assert ["test_slurm"] in started and ["test_resume"] in started, started  # the two heaviest, then a light one
