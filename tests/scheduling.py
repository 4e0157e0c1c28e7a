"""How the suite's tests are spread over pytest-xdist's workers (`-n 3` on 2 cores, README's test command): whole
modules, the heaviest first, and test_multinode alone.

- Three workers on two cores: many tests mostly wait (a rank time-out, elastic's 30 s SIGTERM grace, slurmctld's
  time-limit pass, a killed launcher's restart), and with two workers the cores sat idle 17% of the suite (sampled
  every 10 s; 1147 s in all). A third worker fills that time: 1020 s, 12% idle, most of it in the cluster unit. The
  fast tier only computes, and runs best on two (141 s against 157 s on three).

- A module is one unit of work (as `--dist loadfile`): its module-scoped fixtures (reference runs, matrix
  launches) are made once, by the worker that runs it; split over workers they would be made twice.
- test_multinode (two machines in network namespaces) is the "cluster" unit, and it runs alone, first: each of its
  tests runs two or three launchers of several processes at once, and beside another worker's 2-rank launches
  (ranks waiting in collectives spin) they took 4x their time alone (measured: 18 min instead of 4), near their own
  time-outs. Alone it leaves the cores about 30% idle, but the modules that launch nothing, run beside it, were
  worse twice: on the slower machine its launches took 1260 s instead of 837 s, and on three workers the suite took
  1049 s instead of 1020 s (its idle stretches stayed, and the end of the suite lost the light modules that even out
  the workers' last minutes).
- test_slurm (a SLURM cluster of its own namespaces) runs beside other work, started right after the cluster unit:
  its jobs mostly wait (5 s per step, slurmctld's time-limit pass every 30 s), and alone it left the machine 70-100%
  idle for about 2 of its 3 minutes (measured with the cluster unit holding both modules).
- The heaviest units start first (longest processing time first), so the last unit to finish is a short one. The
  weights are the seconds each took in a measured run of the suite (`.pytest_launches.jsonl` and pytest's durations);
  a module missing from the table counts as light.

xdist's own `--dist loadgroup` would group by `xdist_group` marks, but xdist 3.8 marks a test's group by rewriting
`item._nodeid`, which pytest 9 no longer reads: the groups are silently ignored. A scheduler of our own (xdist's
`pytest_xdist_make_scheduler` hook) decides the units from the node ids instead.
"""

from __future__ import annotations

from collections import OrderedDict

CLUSTER_MODULES = ("test_multinode",)
EXCLUSIVE_UNITS = ("cluster",)  # units that run with no other unit beside them

# Seconds of launches per unit, measured in a full run of the suite (launch log, both workers busy, 2026-11-26;
# test_quantization_runs estimated after its FSDP and ZeRO-3 launches were added); the order matters, not the values'
# precision. test_slurm is weighted to start first after the cluster unit (its waiting overlaps the rest).
WEIGHTS_S = {
    "cluster": 1000, "test_slurm": 900, "test_resume": 840, "test_workers": 480, "test_grpo_runs": 370,
    "test_moe": 330,
    "test_preference": 280, "test_strategies": 270, "test_quantization_runs": 250, "test_loss": 245,
    "test_guards": 225, "test_sequence_parallel_runs": 210, "test_hub": 200, "test_e2e": 150, "test_eval": 140,
    "test_wheel": 120, "test_compression": 120, "test_exit_codes": 115, "test_data_cache": 60, "test_checkpoints": 50,
    "test_stream": 30, "test_stop_signals": 80, "test_matrix": 27, "test_security": 18, "test_bad_input": 10,
    "test_compile": 11, "test_outdir": 5, "test_forked": 3, "test_claim": 3, "test_launch_log": 2,
}


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its module's name, or "cluster"."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return "cluster" if module in CLUSTER_MODULES else module


def make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with our units, handed out heaviest first (the exclusive ones before all), an
        exclusive unit only to an idle machine and nothing beside it until it is done."""

        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _running(self, exclusive: bool, besides=None) -> bool:
            """A node other than `besides` has unfinished tests of an exclusive unit (exclusive=True) or of any unit
            (False)."""
            return any(not all(tests.values()) for other, units in self.assigned_work.items() if other is not besides
                       for unit, tests in units.items() if not exclusive or unit in EXCLUSIVE_UNITS)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the queue is complete when the first unit is handed out
                self.workqueue = OrderedDict(sorted(
                    self.workqueue.items(), key=lambda unit: (unit[0] not in EXCLUSIVE_UNITS,
                                                              -WEIGHTS_S.get(unit[0], 0))))
                self.ordered = True
            # The node running an exclusive unit may queue the next unit behind it (an xdist worker holds its last
            # test back until it has more work or is told to stop); the others get nothing beside it.
            if self._running(exclusive=True, besides=node):
                return  # mark_test_complete hands them work once it is done
            if next(iter(self.workqueue)) in EXCLUSIVE_UNITS and self._running(exclusive=False, besides=node):
                return  # an exclusive unit waits for the other machines to be idle
            super()._assign_work_unit(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            if not self._running(exclusive=True):  # the other nodes may be idle, waiting for it (or, the queue
                for other in self.nodes:               # empty, waiting to be shut down)
                    if other is not node:
                        self._reschedule(other)

    return ModuleScheduling(config, log)
