"""The launcher owns its workers (issue 17, point 4): SIGKILL or SIGINT of `accelerate launch` / `hftrain launch`
ends every worker within seconds and nothing is written after; a SIGSTOPped rank fails the job within
strategy.rank_timeout, named. The heartbeat's logic is unit-tested on a store in a dict; the rest on 2 CPU ranks."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from tests.support import free_port
from hftrain.lifetime import DONE, Heartbeat

from .conftest import ACCELERATE_LAUNCH, DEMO_TRAIN, PY, REPO, assert_no_process_left, processes_mentioning


class DictStore:
    """The slice of a c10d Store the heartbeat uses; `fail` makes every call raise (a store host gone)."""

    def __init__(self):
        self.data, self.fail = {}, False

    def _check(self):
        if self.fail:
            raise RuntimeError("Connection reset by peer")

    def set(self, key, value):
        self._check()
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self._check()
        return self.data[key]

    def check(self, keys):
        self._check()
        return all(k in self.data for k in keys)


def heartbeat(store, rank, world=3, timeout=30.0):
    exits = []
    return Heartbeat(store, rank, world, timeout, interval=5.0, exit=exits.append), exits


def test_rank_0_names_the_rank_whose_counter_stopped(capsys):
    store = DictStore()
    hb0, exits = heartbeat(store, 0)
    hb1, _ = heartbeat(store, 1)
    hb2, _ = heartbeat(store, 2)
    hb2.me = "node7 4242"
    for t in range(0, 30, 5):  # everyone beats: nothing happens
        for seq, hb in enumerate((hb1, hb2, hb0)):
            hb.beat(t + seq, now=float(t))
    assert exits == [] and hb0.watched == [1, 2] and hb1.watched == [0]
    for t in range(30, 70, 5):  # rank 2 stops at t=25; rank 1 goes on
        hb1.beat(t, now=float(t))
        hb0.beat(t, now=float(t))
    assert exits and exits[0] == 1, exits
    err = capsys.readouterr().err
    assert "rank 2 (host node7, pid 4242) has not answered for 35 s (stopped, hung or dead)" in err, err
    assert "rank 1" not in err.split("has not answered")[0].split("rank 0:")[1]
    assert "strategy.rank_timeout" in err


def test_a_rank_that_ended_normally_is_not_waited_for():
    store = DictStore()
    hb0, exits = heartbeat(store, 0, world=2)
    hb1, _ = heartbeat(store, 1, world=2)
    hb1.beat(1, now=0.0)
    hb0.beat(1, now=0.0)
    hb1.stop()  # its thread never started: stop only marks it done
    assert store.data[hb1.prefix + "1"].decode().startswith(DONE + " ")
    for t in range(5, 200, 5):
        hb0.beat(t, now=float(t))
    assert exits == []


def test_a_rank_that_never_beats_is_named_and_a_store_that_stops_answering_ends_the_rank(capsys):
    store = DictStore()
    hb1, exits = heartbeat(store, 1, world=2)  # rank 0 never starts
    for t in range(0, 40, 5):
        hb1.beat(t, now=float(t))
    assert exits == [1] and "rank 0 (host unknown, pid unknown) has not started its heartbeat for 35 s" in \
        capsys.readouterr().err
    hb0, exits = heartbeat(store, 0, world=2)
    store.fail = True
    for t in range(0, 30, 5):  # failing, but not for longer than the timeout yet
        hb0.beat(t, now=float(t))
    assert exits == []
    hb0.beat(35, now=35.0)
    assert exits == [1] and "the job's store" in capsys.readouterr().err


# -- 2 CPU ranks ------------------------------------------------------------------------------------------------


def recipe(tmp, model_dir, **strategy):
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump({
        "model": {"name_or_path": model_dir, "dtype": "float32"},
        "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 32},
        "training": {"output_dir": str(tmp / "out"), "max_steps": 40, "save_steps": 2, "save_total_limit": 2,
                     "per_device_train_batch_size": 2, "learning_rate": 1e-3, "logging_steps": 1,
                     "report_to": "none", "disable_tqdm": True, "seed": 0},
        "strategy": {"main_process_port": free_port(), **strategy},
    }))
    return str(p)


def accelerate_cmd(rec):
    port = yaml.safe_load(open(rec))["strategy"]["main_process_port"]
    return [*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
            "--main_process_port", str(port), "tests/slow_sft.py", rec, "strategy.name=ddp"]


def hftrain_cmd(rec):
    return [PY, "-m", "hftrain.cli", "launch", rec, "--script", "tests/slow_sft.py"]


def deepspeed_cmd(rec):
    """DeepSpeed's runner (the `deepspeed` command): it starts a node launcher (deepspeed.launcher.launch), which
    starts the workers; `--num_gpus 2` makes it start 2 on CPU, `--no_local_rank` keeps --local_rank off the recipe's
    arguments. The workers run DDP (no DeepSpeed config: the launcher is only a process launcher here)."""
    port = yaml.safe_load(open(rec))["strategy"]["main_process_port"]
    return [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), "--no_local_rank",
            "tests/slow_sft.py", rec, "strategy.name=ddp"]


LAUNCH_COMMANDS = {"accelerate": accelerate_cmd, "hftrain": hftrain_cmd, "deepspeed": deepspeed_cmd}


def start_until_training(cmd, sleep=0.5, timeout=300):
    """Start the launch (slowed steps), return it once the first loss line is printed, with the output so far."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HFTRAIN_TEST_STEP_SLEEP=str(sleep))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines, t0 = [], time.time()
    for line in proc.stdout:
        lines.append(line)
        if "{'loss': " in line:
            return proc, lines
        if time.time() - t0 > timeout:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("no loss line:\n" + "".join(lines)[-4000:])


def snapshot(folder) -> dict:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, fs in os.walk(folder) for f in fs}


def worker_pids(marker) -> dict[int, int]:
    """rank -> pid of the training processes of a run (their environment holds RANK and LOCAL_RANK)."""
    out = {}
    for pid in processes_mentioning(marker):
        try:
            env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and b"LOCAL_RANK" in env:  # the launcher itself was started without them
            out[int(env[b"RANK"])] = pid
    return out


@pytest.mark.launches
@pytest.mark.parametrize("launcher,sig", [("accelerate", signal.SIGKILL), ("accelerate", signal.SIGINT),
                                          ("hftrain", signal.SIGKILL), ("hftrain", signal.SIGINT),
                                          ("hftrain", signal.SIGTERM), ("deepspeed", signal.SIGKILL)],
                         ids=["accelerate-kill", "accelerate-int", "hftrain-kill", "hftrain-int", "hftrain-term",
                              "deepspeed-kill"])
def test_workers_end_with_their_launcher_and_write_nothing_after(launcher, sig, tmp_path, tiny_model_dir):
    rec = recipe(tmp_path, tiny_model_dir)
    proc, lines = start_until_training(LAUNCH_COMMANDS[launcher](rec))
    try:
        workers = worker_pids(rec)
        assert sorted(workers) == [0, 1], processes_mentioning(rec)
        os.kill(proc.pid, sig)
        t0 = time.time()
        # without the parent-death signal they would run on for good: a minute is room for a loaded machine
        while set(workers.values()) & set(processes_mentioning(rec)) and time.time() - t0 < 60:
            time.sleep(0.1)
        gone = time.time() - t0
        # The workers first (within seconds); the launchers' own interpreter exit can take seconds on a busy machine.
        assert not set(workers.values()) & set(processes_mentioning(rec)), processes_mentioning(rec)
        assert_no_process_left(rec, within=60)
        out = tmp_path / "out"
        before = snapshot(out)
        time.sleep(3)
        assert snapshot(out) == before  # nothing written after the workers ended
        assert not (out / "model.safetensors").exists()
        rest, _ = proc.communicate(timeout=60)
        print(f"{launcher} {signal.Signals(sig).name}: workers gone {gone:.1f} s after, "
              f"launcher status {proc.returncode}")
        if sig != signal.SIGKILL:  # torch elastic stopped its workers; the status is the launcher's
            assert proc.returncode not in (0, None), "".join(lines)[-2000:] + rest[-3000:]
        if launcher == "hftrain" and sig != signal.SIGKILL:  # 130 / 143 and one line, never a traceback (issue 33)
            assert proc.returncode == 128 + sig and "Traceback" not in rest, rest[-3000:]
            assert f"hftrain: the launcher got {signal.Signals(sig).name}: its workers were stopped" in rest
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.launches
@pytest.mark.parametrize("stopped", [1, 0])
def test_a_stopped_rank_fails_the_job_within_the_timeout_naming_it(stopped, tmp_path, tiny_model_dir):
    """Rank 0 watches the others, the others watch rank 0. The job ends about rank_timeout + 30 s after the stop:
    torch elastic gives the stopped worker 30 s to answer its SIGTERM before the SIGKILL."""
    rec = recipe(tmp_path, tiny_model_dir, rank_timeout=15)
    proc, lines = start_until_training(accelerate_cmd(rec))
    pids = worker_pids(rec)
    try:
        assert sorted(pids) == [0, 1], processes_mentioning(rec)
        os.kill(pids[stopped], signal.SIGSTOP)
        t0 = time.time()
        rest, _ = proc.communicate(timeout=15 + 300)  # without the watch: gloo's own 30 min
        took = time.time() - t0
        out = "".join(lines) + rest
        print(f"stopped rank {stopped}: the job ended {took:.0f} s later with status {proc.returncode}")
        assert proc.returncode not in (0, None), out[-4000:]
        message = f"rank {stopped} (host {socket.gethostname()}, pid {pids[stopped]}) has not answered for"
        assert message in out, out[-4000:]
        # rank_timeout + torch elastic's 30 s grace, with room for a loaded machine: far below gloo's 30 min
        assert "(stopped, hung or dead)" in out and took < 15 + 240, took
        assert_no_process_left(rec, within=60)
    finally:
        for pid in pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)


# -- `hftrain launch`'s child (lifetime.run_owned), without training ---------------------------------------------

OWNER = """
import sys
from hftrain.lifetime import run_owned
sys.exit(run_owned([sys.executable, "-c", sys.argv[1], sys.argv[2]]))
"""
SLEEPER = "import signal, sys, time; print('child up', flush=True); time.sleep(120)"


@pytest.fixture
def marker():
    """A string in the command lines of one test's processes only; they are SIGKILLed at its end whatever happened."""
    m = f"hftrain-owned-{uuid.uuid4().hex}"
    yield m
    for pid in processes_mentioning(m):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def start_owner(child_code, marker):
    proc = subprocess.Popen([PY, "-c", OWNER, child_code, marker], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout.readline() == "child up\n"
    return proc


def test_run_owned_returns_the_child_status():
    from hftrain.lifetime import run_owned

    assert run_owned([PY, "-c", "import sys; sys.exit(3)"]) == 3
    assert run_owned([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]) == 128 + signal.SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
@pytest.mark.launches
def test_run_owned_forwards_signals_to_the_child(sig, marker):
    proc = start_owner(SLEEPER, marker)
    assert len(processes_mentioning(marker)) == 2  # the owner and its child
    os.kill(proc.pid, sig)
    # The child got the signal and ended of it (Python ends itself by SIGINT after an unhandled KeyboardInterrupt):
    # the owner reports 128 + N.
    assert proc.wait(timeout=30) == 128 + sig
    assert_no_process_left(marker, within=60)


@pytest.mark.launches
def test_the_child_dies_when_its_owner_is_sigkilled(marker):
    proc = start_owner(SLEEPER, marker)
    assert len(processes_mentioning(marker)) == 2
    proc.kill()
    proc.wait()
    assert_no_process_left(marker, within=60)


# -- DeepSpeed's runner -> node launcher -> worker chain, without training --------------------------------------

FAKE_RUNNER = """
import subprocess, sys
# argv holds 'deepspeed.launcher.runner' (as `python -m deepspeed.launcher.runner` does): it starts the node launcher
subprocess.Popen([sys.executable, "-c", sys.argv[2], "deepspeed.launcher.launch", sys.argv[3], sys.argv[4]]).wait()
"""
FAKE_NODE_LAUNCHER = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]]).wait()  # not owned by the runner: lives on
"""
WORKER = """
import time
from hftrain.lifetime import die_with_parent, launched_by_a_launcher
assert launched_by_a_launcher()
die_with_parent(poll_seconds=0.2)
print("worker up", flush=True)
time.sleep(120)
"""


@pytest.mark.launches
def test_a_worker_of_deepspeeds_launcher_dies_with_the_runner_too(marker):
    """`deepspeed` (the runner) starts deepspeed.launcher.launch, which starts the workers: the node launcher does not
    end with a SIGKILLed runner, so the worker watches the runner as well as its parent (lifetime.outer_launchers)."""
    proc = subprocess.Popen([PY, "-c", FAKE_RUNNER, "deepspeed.launcher.runner", FAKE_NODE_LAUNCHER, WORKER, marker],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "worker up\n"
        worker = [pid for pid in processes_mentioning(marker)
                  if open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[2] == WORKER.encode()]
        assert len(worker) == 1, processes_mentioning(marker)
        proc.kill()  # the runner
        t0 = time.time()
        while worker[0] in processes_mentioning(marker) and time.time() - t0 < 10:
            time.sleep(0.1)
        assert worker[0] not in processes_mentioning(marker), "the worker outlived DeepSpeed's runner"
    finally:
        proc.kill()
        proc.wait()


ORPHANED_WORKER = """
import os, sys, time
while os.getppid() != 1:  # its launcher ends before it imports hftrain (the moment the kernel's signal misses)
    time.sleep(0.05)
import hftrain  # noqa: E402
open(sys.argv[1], "w").write("still running")
"""


@pytest.mark.launches
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="re-parenting to init is read from /proc")
def test_an_elastic_worker_whose_launcher_ended_before_it_imported_hftrain_ends_at_the_import(tmp_path):
    """torch elastic's worker arms the parent-death signal at hftrain's first import; a launcher already gone by then
    left it re-parented to init and training on (seen once in the chaos test): it ends at the import instead."""
    wrote = tmp_path / "wrote.txt"
    launcher = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
                "stderr=open(sys.argv[3], 'w'))")
    subprocess.run([PY, "-c", launcher, ORPHANED_WORKER, str(wrote), str(tmp_path / "stderr.txt")], check=True,
                   cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TORCHELASTIC_RUN_ID="orphan-test"), timeout=60)
    assert_no_process_left(str(wrote), within=60)
    assert not wrote.exists(), "the orphaned worker went on past hftrain's import"
    assert "launcher ended before it started" in (tmp_path / "stderr.txt").read_text()
