"""SLURM's stop signal (SIGUSR1, sent ahead of a job's time limit) on plain processes, no cluster: one process saves a
checkpoint and stops, and its resumed run ends as one never stopped; a request to one rank of two stops every rank after
the same step. Apart from tests/test_slurm.py because they stand up no cluster and need no SLURM installed."""

import os
import signal
import subprocess

import pytest

from hftrain.checkpoints import verify

from .conftest import PY, REPO
from .test_slurm import SLOW_SFT, _published, _run, close, losses, recipe


@pytest.mark.launches
def test_sigusr1_saves_a_checkpoint_stops_and_the_resumed_run_ends_as_one_never_stopped(tmp_path, tiny_model_dir):
    """One process, SIGUSR1 mid-run: checkpoint-N published and verified, exit 0, no final save; the run resumed from
    it ends with the losses and weights of a run never stopped."""
    ref = recipe(tmp_path, tiny_model_dir, tmp_path / "ref", machines=1, processes=1, max_steps=8)
    r = _run(["-m", "hftrain.recipes.sft", ref])
    assert r.returncode == 0, r.stderr[-3000:]
    rec = recipe(tmp_path, tiny_model_dir, tmp_path / "out", machines=1, processes=1, max_steps=8)
    marker = tmp_path / "stopped"  # the SLURM script's sign to requeue: written once the checkpoint is saved
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HFTRAIN_TEST_STEP_SLEEP": "0.5",
           "HFTRAIN_STOP_MARKER": str(marker)}
    proc = subprocess.Popen([PY, SLOW_SFT, rec], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "{'loss': " in line:
            proc.send_signal(signal.SIGUSR1)
            break
    rest, _ = proc.communicate(timeout=300)
    log = "".join(lines) + rest
    out = tmp_path / "out"
    assert proc.returncode == 0, log[-3000:]
    assert "stop requested (SIGUSR1" in log and not (out / "run_info.json").exists(), log[-3000:]
    saved = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    step = int(saved[-1].split("-")[1])
    assert f"stopped after step {step} of 8" in log and step < 8, log[-3000:]
    verify(str(out / saved[-1]))
    assert marker.read_text() == f"{out / saved[-1]}\n"
    r = _run(["-m", "hftrain.recipes.sft", rec, "training.resume_from_checkpoint=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert close(losses(out), losses(tmp_path / "ref")), (losses(out), losses(tmp_path / "ref"))


@pytest.mark.launches
def test_a_request_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, tiny_model_dir):
    """2 processes (accelerate launch), SIGUSR1 to rank 1 only (as when the nodes' signals come at different steps):
    both ranks stop after the same step, which is saved whole (both ranks' RNG states, verified), and exit 0."""
    from .test_workers import accelerate_cmd, recipe as workers_recipe, start_until_training, worker_pids

    rec = workers_recipe(tmp_path, tiny_model_dir)  # 40 steps, a checkpoint every 2, slowed steps
    proc, lines = start_until_training(accelerate_cmd(rec), sleep=0.5)
    try:
        workers = worker_pids(rec)
        assert sorted(workers) == [0, 1]
        os.kill(workers[1], signal.SIGUSR1)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = "".join(lines) + rest
    out = tmp_path / "out"
    assert proc.returncode == 0, log[-3000:]
    step = int(log.split("every rank stopped after step ")[1].split()[0])
    assert step < 40 and not (out / "run_info.json").exists()
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(out / f"checkpoint-{step}"))
    verify(str(out / f"checkpoint-{step}"))
    assert _published(out)[-1] == f"checkpoint-{step}"
