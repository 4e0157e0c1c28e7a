"""Launches from a preloaded interpreter (issue 36): where the launcher is not under test, a launch's processes are
forked from a server that imported torch, transformers, TRL, DeepSpeed and hftrain once for the pytest worker,
instead of each paying the imports again (12-15 s of CPU per process on the suite's 2-core machine, three processes
for a 2-rank launch: the launcher and its ranks).

The server is the standard library's forkserver (`multiprocessing`'s "forkserver" context with a preload list): a
fresh interpreter, single-threaded, that forks one child per launch. The child plays the command it was given:

- `accelerate launch ...` (conftest.ACCELERATE_LAUNCH): accelerate's own launch code runs in the child, so the
  environment it gives its ranks comes from the shipped config file exactly as in a real launch; only torch elastic's
  agent (`torch.distributed.run.run`) is replaced, by `_fork_ranks`, which forks the ranks with the variables torchrun
  gives each (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), ends the others when one fails (as the agent does),
  and exits 1 then;
- `python -m torch.distributed.run ...`: torchrun's own argument parsing, then `_fork_ranks`;
- `python SCRIPT ARGS` or `python -m MODULE ARGS`: the script or module as `__main__` (runpy), with sys.argv set.

Each launch is a session of its own (killed whole on a time-out, like conftest.run's process group); its standard
output and error go to files read back into the CompletedProcess conftest.run returns, both ranks appending to the
same file as they would write to the launcher's pipe. A rank ends as an interpreter does: non-daemon threads joined,
atexit handlers run, streams flushed.

What a fork cannot give a launch is an environment read when a library is first imported (huggingface_hub's and
datasets' caches and endpoints, transformers' verbosity): a launch whose environment changes such a variable, or any
command other than the two above, gets a real process (`conftest.run`). Tests of the launcher itself (signals,
elastic restarts, killed launchers, SLURM, several machines) launch real processes and do not come here.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import resource
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from hftrain.launch.machine import extensions_dir
from hftrain.launch.op_cache import build_locks
from tests.support import LaunchTimedOut, cpu_seconds, session_processes

PRELOAD = ["hftrain.recipes.sft", "hftrain.methods.grpo.grpo", "hftrain.methods.preference.dpo", "hftrain.cli", "trl",
           "deepspeed", "accelerate.commands.launch", "torch.distributed.run",
           "matplotlib.pyplot",  # every run's main process plots its curves (hftrain.artifacts); headless: Agg
           "tests.frozen_heap"]  # last: the heap the imports made, frozen for every fork (a full collection: 0.37 s)
# Read when a library is first imported: a launch that changes one gets a fresh interpreter.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TRL_", "DS_", "DEEPSPEED_", "PYTHON",
                        "OMP_", "MKL_", "TORCH_", "CUDA_", "LD_")
RUNTIME_EXCEPTIONS = ("PYTHONUNBUFFERED", "TORCH_EXTENSIONS_DIR")  # read when used, not at import
ACCELERATE_MODULE, TORCHRUN_MODULE = "accelerate.commands.launch", "torch.distributed.run"
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun exports for its workers
STOP_GRACE_S = 30.0  # after one rank fails, the others' time to end on SIGTERM before SIGKILL (the elastic agent's)
# The server imports its preload under the environment the suite started with (conftest imports this module before
# any test runs), not under whatever the test that first launches has patched.
SERVER_ENV = dict(os.environ)
CPU_FILE = "cpu_seconds"  # beside the launch's stdout and stderr files
_context = None


def _server():
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        environ = dict(os.environ)
        os.environ.clear()
        os.environ.update(SERVER_ENV)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(environ)
        _context = context
    return _context


def forkable(cmd: list[str], env: dict[str, str]) -> bool:
    """Whether `cmd` with `env` can be played by a fork of the preloaded server."""
    if not cmd or cmd[0] != sys.executable or len(cmd) < 2:
        return False
    changed = {k for k in set(env) | set(SERVER_ENV) if env.get(k) != SERVER_ENV.get(k)}
    return not any(k.startswith(IMPORT_TIME_PREFIXES) and k not in RUNTIME_EXCEPTIONS for k in changed)


def launch(cmd: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """Play `cmd` in a fork of the preloaded server; the same result as conftest.run's real launch."""
    ctx = _server()
    with tempfile.TemporaryDirectory(prefix="hftrain-forked-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        proc = ctx.Process(target=_play, args=(list(cmd), dict(env), cwd, out, err), name="hftrain-forked-launch")
        proc.start()
        proc.join(timeout)
        timed_out = proc.is_alive()
        if timed_out:
            extensions = env.get("TORCH_EXTENSIONS_DIR") or extensions_dir()
            processes, locks = session_processes(proc.pid), build_locks(extensions)
            _kill_session(proc.pid)
            proc.join()
        stdout, stderr, cpu = (_read(path) for path in (out, err, os.path.join(folder, CPU_FILE)))
    if timed_out:
        raise LaunchTimedOut(cmd, timeout, stdout, stderr, processes, locks)
    result = subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)
    result.cpu_seconds = float(cpu) if cpu else None  # for the launch log: this launch is no child of pytest's
    return result


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as fh:
        return fh.read()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# in the forked child


def _play(cmd: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.setsid()
    _redirect(out, err)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    args = cmd[1:]
    if args[:2] == ["-m", ACCELERATE_MODULE]:
        code = _exit_code(lambda: _accelerate_launch(args[2:]))
    elif args[:2] == ["-m", TORCHRUN_MODULE]:
        code = _exit_code(lambda: _torchrun(args[2:]))
    else:
        _fresh_interpreter(launched=False)
        code = _exit_code(lambda: _run_python(args))
    _finish()
    _write_cpu_seconds(os.path.join(os.path.dirname(out), CPU_FILE))
    os._exit(code)


def _write_cpu_seconds(path: str) -> None:
    """This launch's CPU seconds and its ranks' (a forked child's usage starts at zero)."""
    with open(path, "w") as fh:
        fh.write(str(cpu_seconds(resource.RUSAGE_SELF) + cpu_seconds(resource.RUSAGE_CHILDREN)))


def _redirect(out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # as PYTHONUNBUFFERED: ranks interleave whole writes


def _run_python(args: list[str]) -> None:
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


def _accelerate_launch(args: list[str]) -> None:
    import torch.distributed.run as torchrun
    from accelerate.commands import launch as accelerate_launch

    torchrun.run = _fork_ranks
    sys.argv = ["accelerate-launch", *args]
    accelerate_launch.main()


def _torchrun(args: list[str]) -> None:
    import torch.distributed.run as torchrun

    torchrun.run = _fork_ranks
    torchrun.main(args)


def _exit_code(body) -> int:
    try:
        body()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit status 1
        traceback.print_exc()
        return 1
    return 0


def _finish() -> None:
    """What an interpreter does on its way out: join non-daemon threads, run atexit handlers, flush."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _fresh_interpreter(launched: bool) -> None:
    """hftrain noted its parent when the server imported it (hftrain.PARENT_PID_AT_START: a worker whose parent
    changed has lost its launcher and ends itself); a forked worker's parent is the launch's child, so note it again,
    and arm the parent-death signal hftrain's first import arms under torch elastic."""
    import hftrain
    import hftrain.lifetime as lifetime

    hftrain.PARENT_PID_AT_START = lifetime.PARENT_PID_AT_START = os.getppid()
    if launched:
        lifetime.set_parent_death_signal()


def _rank_env(args, rank: int, world: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default", "MASTER_ADDR": args.master_addr or "127.0.0.1",
            "MASTER_PORT": str(args.master_port), "TORCHELASTIC_RUN_ID": "hftrain-forked",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE}


def _fork_ranks(args) -> None:
    """torch.distributed.run.run's part for one machine: fork `nproc_per_node` ranks of the training script; when one
    fails, SIGTERM the others (SIGKILL after STOP_GRACE_S) and exit 1, as the elastic agent does."""
    if str(args.nnodes) not in ("1", "1:1") or args.module or args.no_python:
        raise SystemExit(f"tests/forked.py plays one machine's launch of a script, not {vars(args)}")
    world = int(args.nproc_per_node)
    script = [args.training_script, *args.training_script_args]
    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update(_rank_env(args, rank, world))
            _fresh_interpreter(launched=True)
            code = _exit_code(lambda: _run_python(script))
            _finish()
            os._exit(code)
        ranks[pid] = rank
    failure = _wait_ranks(ranks, float(args.monitor_interval))
    if failure is not None:
        print(f"tests/forked.py: rank {failure[0]} exited with status {failure[1]}; the others were stopped",
              file=sys.stderr, flush=True)
        raise SystemExit(1)


def _wait_ranks(ranks: dict[int, int], interval: float) -> tuple[int, int] | None:
    """Reap the ranks, looking every `interval` seconds (the agent's monitor interval, accelerate's default 0.1 s)."""
    failure, kill_at = None, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                _signal_all(ranks, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(interval)
            continue
        code = os.waitstatus_to_exitcode(status)
        rank = ranks.pop(pid, None)
        if rank is not None and code != 0 and failure is None:
            failure, kill_at = (rank, code), time.monotonic() + STOP_GRACE_S
            _signal_all(ranks, signal.SIGTERM)
    return failure


def _signal_all(ranks: dict[int, int], sig: int) -> None:
    for pid in ranks:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
