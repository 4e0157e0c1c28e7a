"""`hftrain launch --ray ADDRESS` (issue 68) on a Ray cluster this module starts on 127.0.0.1: each machine of the
recipe a Ray task running its own `hftrain launch --machine-rank K`. A 2-machine run on Ray equals the same run under
`hftrain launch` on one machine (losses and weights bit for bit: the same two DDP ranks); a machine whose rank is
killed fails the job, named, and nothing of the run is left running. The cluster is ended by its processes' pids
(its own temporary folder names them), never by `ray stop`, which would stop every Ray process of the machine."""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from .conftest import REPO, processes_mentioning, uneven_data
from .support import free_port

pytestmark = [pytest.mark.launches, pytest.mark.cluster]  # a cluster of its own: run alone (scripts/test.sh)
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
STARTED = "Ray runtime started"


def _in_session(sid: int) -> list[int]:
    """The live processes of session `sid` (Ray renames its workers `ray::...`: their command lines name nothing)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[3]) == sid:
            found.append(pid)
    return found


def _end(marker: str, head: subprocess.Popen) -> None:
    """SIGTERM the head (a session of its own: every Ray process it starts stays in it), then SIGKILL whatever of
    that session, or naming the cluster's folder, is left (the head took over 30 s to stop on its own: measured)."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=3)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in set(_in_session(head.pid)) | set(processes_mentioning(marker)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster on 127.0.0.1 (4 CPUs), its address; its own short temporary folder (Ray's sockets
    live there, and Unix socket paths are short)."""
    pytest.importorskip("ray")
    folder = tempfile.mkdtemp(prefix="hftrain-ray-", dir="/tmp")
    port = free_port()
    log = open(os.path.join(folder, "head.log"), "w")
    head = subprocess.Popen([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                             "--num-cpus", "4", "--include-dashboard=false", "--disable-usage-stats",
                             "--temp-dir", os.path.join(folder, "t"), "--block"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while STARTED not in open(log.name).read():
            assert head.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        _end(folder, head)
        shutil.rmtree(folder, ignore_errors=True)


def _recipe(tmp, model, data, name, strategy, steps=3, save_steps=3) -> str:
    tree = {"model": {"name_or_path": model, "dtype": "float32"},
            "data": {"sources": [{"path": data}], "max_length": 64},
            "training": {"output_dir": str(tmp / name), "max_steps": steps, "per_device_train_batch_size": 2,
                         "gradient_accumulation_steps": 2, "optim": "sgd", "learning_rate": 0.5,
                         "lr_scheduler_type": "constant", "logging_steps": 1, "save_steps": save_steps,
                         "train_sampling_strategy": "sequential", "seed": 0, "report_to": "none",
                         "disable_tqdm": True},
            "strategy": {"name": "ddp", "main_process_port": free_port(), **strategy}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def _hftrain(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hftrain.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _losses(folder) -> list[float]:
    state = json.load(open(os.path.join(folder, "trainer_state.json")))
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def test_two_machines_on_ray_equal_the_same_run_under_hftrain_launch(ray_cluster, tmp_path, tiny_model_dir):
    data = uneven_data(tmp_path / "data.jsonl")
    on_ray = _recipe(tmp_path, tiny_model_dir, data, "ray", {"num_processes": 2, "num_machines": 2})
    plain = _recipe(tmp_path, tiny_model_dir, data, "plain", {"num_processes": 2})
    r = _hftrain("launch", on_ray, "--ray", ray_cluster)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "machine 0 waiting at" in out and "every machine checked in: rank 1" in out  # hftrain's own rendezvous
    p = _hftrain("launch", plain)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.load(open(tmp_path / "ray" / "run_info.json"))["world_size"] == 2
    assert _losses(tmp_path / "ray") == _losses(tmp_path / "plain")  # measured equal to the last bit
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("ray", "plain"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_rank_fails_the_ray_job_naming_its_machine(ray_cluster, tmp_path, tiny_model_dir):
    data = uneven_data(tmp_path / "data.jsonl")
    recipe = _recipe(tmp_path, tiny_model_dir, data, "killed", {"num_processes": 2, "num_machines": 2,
                                                                 "rank_timeout": 20}, steps=100000, save_steps=5)
    job = subprocess.Popen([sys.executable, "-m", "hftrain.cli", "launch", recipe, "--ray", ray_cluster], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "killed").glob("checkpoint-*")):  # both machines' ranks are training
            assert job.poll() is None and time.monotonic() < deadline, "the job ended, or never trained"
            time.sleep(0.5)
        ranks = {pid: cmd for pid, cmd in processes_mentioning(recipe).items()
                 if "hftrain.recipes.sft" in cmd and "strategy.machine_rank=1" in cmd and "launcher" not in cmd}
        assert len(ranks) == 1, ranks
        os.kill(next(iter(ranks)), signal.SIGKILL)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert re.search(r"hftrain: ray: machine 1 \(node [0-9.]+\) exited with status [1-9]", out), out[-3000:]
    time.sleep(2)
    assert processes_mentioning(recipe) == {}, "the run's processes outlived the failed job"
