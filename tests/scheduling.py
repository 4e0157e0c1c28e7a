"""How the suite's tests are spread over pytest-xdist's workers (`-n 2`, README's test command): whole modules, the
heaviest first, and the cluster modules on one worker.

- A module is one unit of work (as `--dist loadfile`): its module-scoped fixtures (reference runs, matrix
  launches) are made once, by the worker that runs it; split over workers they would be made twice.
- The cluster modules (network namespaces with fixed addresses, SLURM's daemons) are one unit, and it runs alone,
  first: each of its tests runs two or three launchers of several processes at once, and beside another worker's
  2-rank launches (ranks waiting in collectives spin) they took 4x their time alone (measured: test_multinode 18
  min instead of 4), near their own time-outs.
- The heaviest units start first (longest processing time first), so the last unit to finish is a short one. The
  weights are the seconds each took in a measured run of the suite (`.pytest_launches.jsonl` and pytest's durations);
  a module missing from the table counts as light.

- A module's tests that launch nothing (not marked `launches` or `cluster`) are a unit of their own, a light one:
  one process on one core, nothing spinning. Light units run beside the exclusive cluster unit, so the other worker
  is not idle for its 12-18 minutes. Which tests are marked is read from the test files' source (the controller
  does not collect); conftest.py refuses a collection where the marks say otherwise.

xdist's own `--dist loadgroup` would group by `xdist_group` marks, but xdist 3.8 marks a test's group by rewriting
`item._nodeid`, which pytest 9 no longer reads: the groups are silently ignored. A scheduler of our own (xdist's
`pytest_xdist_make_scheduler` hook) decides the units from the node ids instead.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
from collections import OrderedDict

CLUSTER_MODULES = ("test_multinode", "test_slurm")
EXCLUSIVE_UNITS = ("cluster",)  # units that run with no other unit beside them but light ones
LIGHT = "~light"  # the suffix of a module's unit of tests that launch nothing
HEAVY_MARKS = ("launches", "cluster")
TESTS = os.path.dirname(os.path.abspath(__file__))

# Seconds of launches per unit, measured in a full run of the suite (launch log, both workers busy, 2026-11-26;
# test_quantization_runs estimated after its FSDP and ZeRO-3 launches were added); the order matters, not the values'
# precision.
WEIGHTS_S = {
    "cluster": 1860, "test_resume": 840, "test_workers": 480, "test_grpo_runs": 370, "test_moe": 330,
    "test_preference": 280, "test_strategies": 270, "test_quantization_runs": 250, "test_loss": 245,
    "test_guards": 225, "test_sequence_parallel_runs": 210, "test_hub": 200, "test_e2e": 150, "test_eval": 140,
    "test_wheel": 120, "test_compression": 120, "test_exit_codes": 115, "test_data_cache": 60, "test_checkpoints": 50,
    "test_stream": 30, "test_matrix": 27, "test_security": 18, "test_bad_input": 10,
}


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The names of the `pytest.mark.NAME` (called or not) among decorators or a pytestmark value."""
    names = set()
    for d in decorators:
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Attribute) and d.value.attr == "mark":
            names.add(d.attr)
    return names


def heavy_tests_of(path: str) -> set[str]:
    """The test functions of a test file marked launches or cluster, by the file's source: on the function, on its
    class (as "Class::test"), or for the whole module (pytestmark)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            value = node.value
            module_marks |= _marks(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
    heavy = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            if (module_marks | _marks(node.decorator_list)) & set(HEAVY_MARKS):
                heavy.add(node.name)
        elif isinstance(node, ast.ClassDef):
            class_marks = module_marks | _marks(node.decorator_list)
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test") and (
                        (class_marks | _marks(sub.decorator_list)) & set(HEAVY_MARKS)):
                    heavy.add(f"{node.name}::{sub.name}")
    return heavy


@functools.cache
def heavy_tests() -> dict[str, set[str]]:
    """heavy_tests_of every test module, by module name."""
    return {os.path.basename(p).removesuffix(".py"): heavy_tests_of(p)
            for p in glob.glob(os.path.join(TESTS, "test_*.py"))}


def is_heavy(nodeid: str) -> bool:
    path, _, rest = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    return rest.split("[", 1)[0] in heavy_tests().get(module, set())


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its module's name, or "cluster"; the module's tests that launch nothing are the
    unit MODULE~light."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    if not is_heavy(nodeid):
        return module + LIGHT
    return "cluster" if module in CLUSTER_MODULES else module


def make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with our units, handed out heaviest first (the exclusive ones before all), an
        exclusive unit only to an idle machine and nothing beside it until it is done."""

        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _running(self, exclusive: bool, besides=None, heavy_only: bool = False) -> bool:
            """A node other than `besides` has unfinished tests of an exclusive unit (exclusive=True) or of any unit
            (False; heavy_only: of any but a light unit)."""
            return any(not all(tests.values()) for other, units in self.assigned_work.items() if other is not besides
                       for unit, tests in units.items() if (not exclusive or unit in EXCLUSIVE_UNITS)
                       and not (heavy_only and unit.endswith(LIGHT)))

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the queue is complete when the first unit is handed out
                self.workqueue = OrderedDict(sorted(
                    self.workqueue.items(), key=lambda unit: (unit[0] not in EXCLUSIVE_UNITS,
                                                              -WEIGHTS_S.get(unit[0], 0))))
                self.ordered = True
            unit = self._next_unit(node)
            if unit is None:
                return  # mark_test_complete hands it work once the others allow
            self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

        def _next_unit(self, node) -> str | None:
            """The unit `node` may start now: beside an exclusive unit a light one only; an exclusive unit once the
            other nodes run nothing but light units (until then, a light one); else the heaviest."""
            light = next((u for u in self.workqueue if u.endswith(LIGHT)), None)
            # The node running an exclusive unit may queue the next unit behind it (an xdist worker holds its last
            # test back until it has more work or is told to stop); the others get light units beside it.
            if self._running(exclusive=True, besides=node):
                return light
            head = next(iter(self.workqueue))
            if head in EXCLUSIVE_UNITS and self._running(exclusive=False, besides=node, heavy_only=True):
                return light
            return head

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            if not self._running(exclusive=True):  # the other nodes may be idle, waiting for it (or, the queue
                for other in self.nodes:               # empty, waiting to be shut down)
                    if other is not node:
                        self._reschedule(other)

    return ModuleScheduling(config, log)
