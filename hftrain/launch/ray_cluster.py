"""`hftrain launch --ray ADDRESS`: a Ray cluster as the machines of a run.

Ray places the machines and nothing else: one Ray task per machine (strategy.num_machines of them, in a placement
group spread over the cluster's nodes where it can), each running this machine's `hftrain launch --machine-rank K`
as a child it owns (lifetime.run_owned). So the run keeps hftrain's own rendezvous (machine 0's address, taken from
the node Ray placed it on, unless strategy.main_process_ip names one; the machines' check-in) and lifetime rules (a
rank ends with its launcher, a silent rank fails the job by name). A machine whose task fails or whose launch
exits non-zero fails the job, named with its node; the others' tasks are cancelled, which ends their launchers and
ranks. The recipe, the data and output_dir must be on paths every node sees (a shared filesystem), as for any
multi-machine run. Written here rather than taken from Ray Train: its TorchTrainer starts each rank itself with
its own rendezvous, which would bypass hftrain's launch, checks and lifetimes."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .. import lifetime
from ..errors import LaunchError

@dataclass
class MachineResult:
    rank: int
    node: str
    status: int | None  # the launch's exit status; None: the task itself failed
    error: str = ""


def machine_command(command: list[str], recipe_path: str, overrides: list[str], rank: int, machines: int,
                    main_ip: str) -> list[str]:
    """Machine `rank`'s own launch (`command`: the hftrain command and its options, e.g. ["launch", "--script",
    PATH]): the same recipe and overrides, its rank, machine 0's address."""
    return [sys.executable, "-m", "hftrain.cli", *command, recipe_path, *overrides, "--machine-rank", str(rank),
            f"strategy.num_machines={machines}", f"strategy.main_process_ip={main_ip}"]


def node_address() -> str:
    """The address Ray knows this node by (a Ray task's own node)."""
    import ray  # optional dependency: only `--ray` needs it

    return ray.util.get_node_ip_address()


def run_machine(cmd: list[str]) -> tuple[str, int]:
    """A Ray task's body: this node's address and the exit status of its machine's launch, owned by the task."""
    return node_address(), lifetime.run_owned(cmd)


def _ray():
    try:
        import ray  # optional dependency: only `--ray` needs it
    except ImportError:
        raise LaunchError("--ray needs Ray: pip install 'ray[default]' (tested with 2.60)") from None
    return ray


def launch_on_ray(address: str, command: list[str], recipe_path: str, overrides: list[str], machines: int,
                  processes_per_machine: int, gpus: bool, main_ip: str | None) -> int:
    """Run the recipe's machines as Ray tasks on the cluster at `address`; the job's exit status (0: every machine
    ended 0)."""
    ray = _ray()
    ray.init(address=address, log_to_driver=True)
    try:
        return _run(ray, command, recipe_path, overrides, machines, processes_per_machine, gpus, main_ip)
    finally:
        ray.shutdown()


def _run(ray, command, recipe_path, overrides, machines, per_machine, gpus, main_ip) -> int:
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": 1, **({"GPU": per_machine} if gpus else {})}
    group = placement_group([bundle] * machines, strategy="SPREAD")
    ray.get(group.ready())
    task = ray.remote(run_machine)

    def on(k):
        return task.options(num_cpus=1, num_gpus=per_machine if gpus else 0, max_retries=0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(group, k))

    if main_ip is None:  # machine 0's address: the node Ray placed its bundle on
        main_ip = ray.get(ray.remote(node_address).options(
            num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote())
    refs = {on(k).remote(machine_command(command, recipe_path, overrides, k, machines, main_ip)): k
            for k in range(machines)}
    results, first = _wait(ray, refs)
    for r in results:
        if r.status != 0:
            what = f"exited with status {r.status}" if r.status is not None else f"failed: {r.error}"
            print(f"hftrain: ray: machine {r.rank} (node {r.node}) {what}", file=sys.stderr, flush=True)
    return 0 if first is None else (first.status or 1)


def _wait(ray, refs: dict) -> tuple[list[MachineResult], MachineResult | None]:
    """Every machine's result and the first that failed; at that failure the others' tasks are cancelled (their
    launches and ranks end with them)."""
    pending, results = list(refs), []
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=None)
        result = _result(ray, done[0], refs[done[0]])
        results.append(result)
        if result.status != 0:
            for ref in pending:
                ray.cancel(ref, force=True)
            results += [MachineResult(refs[ref], "?", None, "cancelled after another machine failed")
                        for ref in pending]
            return sorted(results, key=lambda r: r.rank), result
    return sorted(results, key=lambda r: r.rank), None


def _result(ray, ref, rank: int) -> MachineResult:
    try:
        node, status = ray.get(ref)
        return MachineResult(rank, node, status)
    except Exception as e:  # the task's worker died (killed, out of memory) or the task raised
        return MachineResult(rank, "?", None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
