"""The SLURM batch script of a recipe (`hftrain config RECIPE --slurm`): submitted as written (`sbatch launch.sbatch`,
from any folder), it runs the recipe on the allocated nodes and comes back by itself after its time limit.

- Resources from the recipe: strategy.num_machines nodes, one task per node (the launcher starts the node's
  num_processes / num_machines workers), whole nodes; GPUs per node only when the run uses them (training.use_cpu
  not true): a CPU cluster's nodes have no gpu GRES, and a job asking for one is never scheduled.
- This interpreter, the launcher and every path by absolute path; the job's log in output_dir/slurm/; the job runs in
  the folder `hftrain config` ran in, which the recipe's relative paths are relative to.
- The main address: the script runs on the allocation's first node, which hosts global rank 0 (machine rank 0 is
  SLURM_NODEID 0); `python -m hftrain.hostaddr` gives its address the others reach (on strategy.socket_ifname, or
  what the hostname resolves to, loopback refused). The socket variables come from launch/network.py.
- Time limit: `--signal=USR1@300` asks SLURM for SIGUSR1 five minutes before the limit. The launchers ignore it (it
  would end them); the ranks save a checkpoint at a step they agree on and exit 0 (stop_request/mixin.py), the main
  process writing the file HFTRAIN_STOP_MARKER names (in the log folder, whatever output_dir the arguments after the
  script override). A run that exits 0 having written it stopped so: the script requeues the job (--requeue), and
  the requeued job (SLURM_RESTART_COUNT, distributed.restart_count) resumes from that checkpoint.
- One node: its ranks meet on 127.0.0.1 (a host whose name resolves to a loopback address is fine there); several:
  on the first node's address the others reach.
sbatch's own options on its command line override the #SBATCH lines (`sbatch --time=4:00:00 --signal=USR1@600 ...`).
"""

from __future__ import annotations

import os
import shlex
import sys

from ..config import Recipe, StrategySection
from ..config.strategy import resolved_strategy
from ..constants import SLURM_DIR, STOP_MARKER_ENV
from ..errors import RecipeError
from ..methods import entry_of
from .network import socket_environment

LAUNCHERS = ("accelerate", "torchrun", "deepspeed")
STOP_SIGNAL_LEAD = 300  # seconds before the time limit; the save of a large model's checkpoint takes minutes


def _q(value) -> str:
    return shlex.quote(str(value))


def _launcher_lines(launcher: str, s: StrategySection, config_path: str | None, per_node: int,
                    ifname: str | None) -> tuple[list[str], str, list[str]]:
    """(the launcher's command before the per-node arguments, the per-node arguments (evaluated on each node),
    the lines preparing it in the batch script)."""
    port = s.main_process_port
    hostaddr = f'"$PY" -m hftrain.hostaddr{" " + _q(ifname) if ifname else ""}'
    if launcher == "accelerate":
        # Machine rank K is SLURM_NODEID K: machine 0, global rank 0's, is the first node, where MAIN_ADDR is.
        cmd = ['"$PY"', "-m", "accelerate.commands.launch", "--config_file", _q(config_path), "--num_machines",
               str(s.num_machines), "--num_processes", str(s.num_processes), "--main_process_ip", '"$MAIN_ADDR"',
               "--main_process_port", str(port)]
        return cmd, '--machine_rank "$SLURM_NODEID"', []
    if launcher == "torchrun":
        # c10d rendezvous hosted by the first node's agent (is_host), each node naming the address it is reached on.
        cmd = ['"$PY"', "-m", "torch.distributed.run", "--nnodes", str(s.num_machines), "--nproc-per-node",
               str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f'"$MAIN_ADDR:{port}"', "--rdzv-id",
               '"hftrain-$SLURM_JOB_ID"']
        node = f'--rdzv-conf "is_host=$(( SLURM_NODEID == 0 ))" --local-addr "$({hostaddr})"'
        return cmd, node, []
    # DeepSpeed's launcher reads the nodes from a hostfile; --no_ssh: each node starts its own part (node_rank).
    prep = ['HOSTFILE="$OUT/%s/hostfile-$SLURM_JOB_ID"' % SLURM_DIR,
            f'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots={per_node}/" > "$HOSTFILE"']
    cmd = ['"$PY"', "-m", "deepspeed.launcher.runner", "--hostfile", '"$HOSTFILE"', "--no_ssh", "--master_addr",
           '"$MAIN_ADDR"', "--master_port", str(port), "--no_local_rank"]
    return cmd, '--node_rank "$SLURM_NODEID"', prep


def slurm_script(recipe: Recipe, strategy: StrategySection, recipe_path: str, overrides: list[str] = (),
                 config_path: str | None = None, launcher: str = "accelerate", module: str | None = None,
                 script: str | None = None, workdir: str | None = None, python: str | None = None,
                 path: str = "launch.sbatch") -> str:
    """The batch script (see the module's docstring). `config_path`: the accelerate config (accelerate launcher);
    `module` / `script`: what to run (default: the recipe's method, as a module of the package); `path`: where the
    script will be, for its header."""
    s = resolved_strategy(strategy)
    _check_launcher(launcher, s)
    per_node = s.num_processes // s.num_machines
    out = os.path.abspath(recipe.output_dir)
    if script is None:
        module = module or f"hftrain.recipes.{entry_of(recipe).script}"
        target = ["--module" if launcher == "deepspeed" else "-m", module]
    else:
        target = [_q(os.path.abspath(script))]
    train = [*target, _q(os.path.abspath(recipe_path)), *(_q(o) for o in overrides), _q(f"strategy.name={s.name}"),
             '"$@"']
    cmd, node_args, prep = _launcher_lines(launcher, s, config_path and os.path.abspath(config_path), per_node,
                                           s.socket_ifname)
    lines = [
        *_header_lines(recipe, s, recipe_path, launcher, workdir, path),
        "set -euo pipefail",
        f"PY={_q(python or sys.executable)}",
        f"OUT={_q(out)}",
        "export PY",
        *_environment_lines(s),
        *prep,
        f"LAUNCH=({' '.join(cmd)})",
        f"TRAIN=({' '.join(train)})",
        *_run_lines(node_args),
    ]
    return "\n".join(lines) + "\n"


def _check_launcher(launcher: str, s: StrategySection) -> None:
    if launcher not in LAUNCHERS:
        raise RecipeError([f"command line: --launcher {launcher!r}: one of {', '.join(LAUNCHERS)}"])
    if launcher == "torchrun" and s.name != "ddp":
        raise RecipeError([f"strategy.name: torchrun starts {s.name} only through accelerate's config: use "
                           "--launcher accelerate (the default), or strategy ddp"])
    if launcher == "deepspeed" and not s.name.startswith("zero"):
        raise RecipeError([f"strategy.name: the DeepSpeed launcher runs the zero* strategies, not {s.name}: use "
                           "--launcher accelerate (the default)"])


def _header_lines(recipe: Recipe, s: StrategySection, recipe_path: str, launcher: str, workdir: str | None,
                  path: str) -> list[str]:
    """The comments saying how to submit it, and the #SBATCH lines."""
    per_node = s.num_processes // s.num_machines
    out = os.path.abspath(recipe.output_dir)
    logs = os.path.join(out, SLURM_DIR)
    gpus = not recipe.typed_training.use_cpu
    what = f"{s.num_machines} node(s) x {per_node} process(es), {'GPUs' if gpus else 'CPUs'}"
    return [
        "#!/bin/bash",
        f"# Generated by `hftrain config --slurm` from {recipe_path} (strategy {s.name}, {what}, {launcher} launcher).",
        "# Submit it from any folder; key=value arguments are recipe overrides, sbatch's own options go before it and",
        "# override the lines below:",
        f"#   sbatch [--time=4:00:00 --partition=P] {os.path.abspath(path)} [key=value ...]",
        f"# SIGUSR1 comes {STOP_SIGNAL_LEAD} s before the time limit: the ranks save a checkpoint and stop, "
        "this script requeues the",
        "# job, and it resumes from that checkpoint. Change strategy.num_machines / num_processes in the recipe, then",
        "# render again, rather than the node count here.",
        f"#SBATCH --job-name={_q('hftrain-' + os.path.basename(out))}",
        f"#SBATCH --nodes={s.num_machines}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpus else []),
        "#SBATCH --exclusive",
        f"#SBATCH --chdir={_q(os.path.abspath(workdir or os.getcwd()))}",
        f"#SBATCH --output={_q(os.path.join(logs, 'slurm-%j.out'))}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=USR1@{STOP_SIGNAL_LEAD}",
        "#SBATCH --requeue",
    ]


def _environment_lines(s: StrategySection) -> list[str]:
    """The network, the node count check, the main address and the stop marker."""
    return [
        "# The network, in one place: the interface the nodes reach each other on (strategy.socket_ifname)"
        + ("." if s.socket_ifname else ": unset, NCCL and gloo bind what the hostname resolves to."),
        *[f"export {k}={_q(v)}" for k, v in socket_environment(s).items()],
        "export PYTHONUNBUFFERED=1",
        f'if [ "$SLURM_NNODES" != {s.num_machines} ]; then',
        f'  echo "hftrain: this script runs {s.num_machines} node(s) but the job has $SLURM_NNODES: set '
        'strategy.num_machines in the recipe and render it again" >&2; exit 2',
        "fi",
        *_main_address_lines(s),
        "export MAIN_ADDR",
        "# The ranks write this file when they stopped on SIGUSR1 with a checkpoint (in the log folder: the run's",
        "# output_dir may be overridden by the arguments after the script).",
        f'export {STOP_MARKER_ENV}="$OUT/{SLURM_DIR}/stopped-$SLURM_JOB_ID"',
        f'rm -f "${STOP_MARKER_ENV}"',
        'echo "hftrain: job $SLURM_JOB_ID (requeued ${SLURM_RESTART_COUNT:-0} times) on $SLURM_JOB_NODELIST, main '
        'address $MAIN_ADDR"',
    ]


def _run_lines(node_args: str) -> list[str]:
    """srun starting one launcher per node, then the requeue when the ranks stopped on SIGUSR1."""
    return [
        "# One launcher per node, SIGUSR1 ignored by it (its default action would end it); the workers it starts",
        "# handle it. The node's own arguments are evaluated on the node.",
        "status=0",
        "srun --kill-on-bad-exit=1 bash -c 'trap \"\" USR1; n=$1; shift; exec \"${@:1:n}\" "
        + node_args.replace("'", "'\\''") + " \"${@:n+1}\"' hftrain-node \"${#LAUNCH[@]}\" \"${LAUNCH[@]}\" "
        "\"${TRAIN[@]}\" || status=$?",
        "# Exit 0 and the marker written: the ranks stopped on SIGUSR1 with a checkpoint. Come back.",
        f'if [ "$status" = 0 ] && [ -e "${STOP_MARKER_ENV}" ]; then',
        '  echo "hftrain: stopped before the time limit, checkpoint saved: requeueing job $SLURM_JOB_ID to resume"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]


def _main_address_lines(s: StrategySection) -> list[str]:
    if s.num_machines == 1:
        return ["# One node: every rank is on this machine.", "MAIN_ADDR=127.0.0.1"]
    return ["# This runs on the allocation's first node, which hosts global rank 0: its address that the other nodes "
            "reach.",
            f'MAIN_ADDR=$("$PY" -m hftrain.hostaddr{" " + _q(s.socket_ifname) if s.socket_ifname else ""})']


def prepare_log_folder(recipe: Recipe) -> str:
    """output_dir/slurm, where the job's log goes: SLURM does not create it, and a job whose log cannot be opened
    fails without a word."""
    path = os.path.join(os.path.abspath(recipe.output_dir), SLURM_DIR)
    os.makedirs(path, exist_ok=True)
    return path
