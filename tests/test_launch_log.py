"""tests/launch_log.py, the suite's cost accounting (issue 36): a forked launch reports the CPU its ranks used, and the
summary adds each file's CPU from the three places it is counted (the pytest process, its reaped children, forked
launches) without counting one twice."""

import os
import re
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


def test_every_module_that_launches_is_weighed_by_the_scheduler():
    """tests/scheduling.py runs a module missing from WEIGHTS_S beside the cluster unit, as light (one pytest process
    computing): a module with tests marked `launches` or `cluster` must be weighed, or its launches would run beside
    test_multinode's, which then take 4x their time, near their time-outs."""
    from tests.scheduling import CLUSTER_MODULES, is_light

    folder = os.path.dirname(os.path.abspath(__file__))
    unweighed = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("test_") and name.endswith(".py") and name[:-3] not in CLUSTER_MODULES:
            with open(os.path.join(folder, name)) as fh:
                if re.search(r"mark\.(launches|cluster)\b", fh.read()) and is_light(name[:-3]):
                    unweighed.append(name)
    assert unweighed == [], f"add these modules to tests/scheduling.py's WEIGHTS_S: {unweighed}"
    assert is_light("test_recipe") and not is_light("test_resume") and not is_light("cluster")


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


def test_the_cluster_unit_runs_first_beside_light_units_only():
    """The scheduler on three simulated workers: test_multinode starts first; while it runs the other workers take
    only modules that launch nothing (tests/scheduling.is_light), and nothing that launches starts until it is done;
    then the heaviest go first."""
    from tests.scheduling import make_scheduler

    collection = [f"tests/{module}.py::t{i}" for module in ("test_multinode", "test_resume", "test_slurm",
                                                             "test_recipe", "test_templates") for i in range(4)]
    sched, nodes = make_scheduler(_Config(), None), [_Node(f"gw{i}") for i in range(3)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()

    def running(node):
        return {collection[i].split("::")[0].split("/")[1][:-3] for i in node.sent} - done

    done: set[str] = set()
    assert running(nodes[0]) == {"test_multinode"}
    assert running(nodes[1]) | running(nodes[2]) <= {"test_recipe", "test_templates"}
    assert running(nodes[1]) and running(nodes[2])  # both light units started beside it
    for node in nodes[1:]:  # the light units end: nothing that launches starts beside the cluster unit
        for i in list(node.sent):
            sched.mark_test_complete(node, i)
    done |= {"test_recipe", "test_templates"}
    assert all(not running(node) for node in nodes[1:]), [n.sent for n in nodes]
    for i in list(nodes[0].sent):
        if "multinode" in collection[i]:
            sched.mark_test_complete(nodes[0], i)
    done.add("test_multinode")
    started = [running(node) for node in nodes]
    assert {"test_slurm"} in started and {"test_resume"} in started, started  # heaviest first, once it is done
