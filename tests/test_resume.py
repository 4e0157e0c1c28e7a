"""Exact resume on 2 CPU ranks: SIGKILL of the whole launch after a checkpoint, then resume, gives the weights of
an uninterrupted run (within the bound resume.killed_vs_uninterrupted.weights, tests/exactness.py) under DDP, FSDP2
and ZeRO-3; a killed worker under --max-restarts 1 costs only the steps since the newest complete checkpoint; a
checkpoint resumes on another number of ranks (DDP, FSDP2, and ZeRO through a universal checkpoint)."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
from safetensors.torch import load_file

from hftrain.checkpoints import newest_complete
from tests.exactness import within
from tests.support import free_port
from hftrain.checkpoints.manifest import manifest_problems, read_manifest
from tests.references import SAVE, STEPS, reference_recipe

from .conftest import (ACCELERATE_LAUNCH, DEMO_EVAL, DEMO_TRAIN, PY, REPO, assert_no_process_left, processes_mentioning,
                       run)

pytestmark = [pytest.mark.launches, pytest.mark.usefixtures("deepspeed_ops")]


def recipe(tmp, model_dir, out, name="recipe.yaml", **training):
    """The reference runs' recipe (tests/references.py): a run killed and resumed must end with their weights."""
    return reference_recipe(tmp, model_dir, out, DEMO_TRAIN, DEMO_EVAL, name=name, **training)


def launch(strategy: str, script: str, args: list[str], processes: int = 2) -> list[str]:
    return [*ACCELERATE_LAUNCH, "--config_file", f"accelerate_configs/{strategy}.yaml", "--num_processes",
            str(processes), "--main_process_port", str(free_port()), script, *args, f"strategy.name={strategy}"]


def weights(out) -> dict:
    return load_file(os.path.join(out, "model.safetensors"))


def common(a: dict, b: dict) -> tuple[dict, dict]:
    """a and b on their common keys."""
    # The tiny model ties lm_head to the embeddings; FSDP's full-state gather on 2 ranks saves the tied copy too.
    for d, other in ((a, b), (b, a)):
        for k in d.keys() - other.keys():
            assert k == "lm_head.weight" and (d[k] == d["model.embed_tokens.weight"]).all(), k
    keys = a.keys() & b.keys()
    return {k: a[k] for k in keys}, {k: b[k] for k in keys}


def start_slow(cmd, sleep: float = 1.0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HFTRAIN_TEST_STEP_SLEEP=str(sleep))
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def wait_for(path, proc, timeout=300):
    t0 = time.time()
    while not os.path.isdir(path):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (status {proc.returncode}) before {path}:\n"
                                 f"{proc.stdout.read()[-4000:]}")
        if time.time() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no {path} after {timeout} s")
        time.sleep(0.05)


def kill_after_first_checkpoint(cmd, out):
    """Start the (slowed) launch, SIGKILL its whole process group once checkpoint-2 is published."""
    proc = start_slow(cmd)
    wait_for(os.path.join(out, f"checkpoint-{SAVE}"), proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: torch elastic's workers sit in sessions of their own
    proc.wait(timeout=60)
    # No worker of the first run survives to write beside the resumed one (they end with their launcher).
    assert_no_process_left(os.path.dirname(str(out)) + os.sep, within=60)
    last = newest_complete(str(out))
    assert last is not None and int(last.rsplit("-", 1)[1]) < STEPS, last
    assert not os.path.exists(os.path.join(out, "model.safetensors"))  # it never got to the final save
    return last


@pytest.fixture(scope="module")
def references(reference_runs):
    """Uninterrupted 2-rank runs per strategy: the session's reference runs (conftest.reference_runs)."""
    return reference_runs


@pytest.fixture
def tiny_model_dir(reference_runs):
    """The model the reference runs trained (the session's shared one)."""
    return reference_runs.model_dir


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_sigkill_of_the_whole_launch_then_resume_is_exact(strategy, tmp_path, tiny_model_dir, references):
    ref = references(strategy)
    out = tmp_path / "out"
    last = kill_after_first_checkpoint(launch(strategy, "tests/slow_sft.py", [recipe(tmp_path, tiny_model_dir, out)]),
                                       out)
    r = run(launch(strategy, "recipes/sft.py", [recipe(tmp_path, tiny_model_dir, out),
                                                "training.resume_from_checkpoint=true"]), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    state = json.load(open(out / "trainer_state.json"))
    steps = [h["step"] for h in state["log_history"] if "loss" in h]
    assert steps == list(range(1, STEPS + 1)), steps  # the first steps come from the checkpoint's history
    k = int(last.rsplit("-", 1)[1])
    assert r.stdout.count("{'loss': ") == STEPS - k, r.stdout[-3000:]  # it trained only the steps after k
    diff = within("resume.killed_vs_uninterrupted.weights", *common(weights(out), weights(ref)), label=strategy)
    print(f"{strategy}: killed, resumed from {os.path.basename(last)}: relative error to uninterrupted {diff:.3g}")


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the training processes under a launcher."""
    import psutil

    out = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.Error, OSError):
            continue
        if "LOCAL_RANK" in env and any("slow_sft.py" in a for a in child.cmdline()):
            out[int(env["RANK"])] = child.pid
    return out


def test_killed_worker_restarts_from_the_newest_complete_checkpoint(tmp_path, tiny_model_dir, references):
    """`hftrain launch --max-restarts 1`: SIGKILL of rank 1 after checkpoint-2; the launcher restarts both workers,
    hftrain resumes them from the newest complete checkpoint, and the final weights equal an uninterrupted run's."""
    ref = references("ddp")
    out = tmp_path / "out"
    cmd = [PY, "-m", "hftrain.cli", "launch", recipe(tmp_path, tiny_model_dir, out), "--max-restarts", "1",
           "--script", "tests/slow_sft.py", f"strategy.main_process_port={free_port()}"]
    proc = start_slow(cmd)
    wait_for(os.path.join(out, f"checkpoint-{SAVE}"), proc)
    pids = worker_pids(proc.pid)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    try:
        # The restarted workers start only after every worker of the first attempt has ended.
        t0, first = time.time(), set(pids.values())
        while proc.poll() is None and time.time() - t0 < 120:
            now = set(worker_pids(proc.pid).values())
            if now and not now & first:
                break
            time.sleep(0.1)
        assert not first & set(processes_mentioning(str(tmp_path) + os.sep)), (first, worker_pids(proc.pid))
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-4000:]
    assert_no_process_left(str(tmp_path) + os.sep, within=60)
    assert "hftrain: restart 1: process group on a fresh store prefix" in stdout, stdout[-4000:]
    assert "hftrain: restarted by the launcher: resuming from " in stdout, stdout[-4000:]
    resumed_from = stdout.split("hftrain: restarted by the launcher: resuming from ", 1)[1].split()[0]
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == 2 and info["global_step"] == STEPS
    diff = within("resume.killed_vs_uninterrupted.weights", *common(weights(out), weights(ref)),
                  label="ddp, rank 1 killed, restarted")
    print(f"ddp: rank 1 killed, restarted from {os.path.basename(resumed_from)}: relative error to ref {diff:.3g}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_checkpoint_resumes_on_one_rank(strategy, tmp_path, tiny_model_dir, references):
    """checkpoint-4 of a 2-rank run, resumed by 1 process with the same global batch (micro-batch 4 instead of
    2 x 2): the data position carries over and the final weights equal the 2-rank run's. FSDP2's sharded state
    goes through torch.distributed.checkpoint, which reshards on load."""
    ref = references(strategy)
    out = tmp_path / "out"
    shutil.copytree(ref / "checkpoint-4", out / "checkpoint-4")
    rec = recipe(tmp_path, tiny_model_dir, out)
    if strategy == "ddp":  # the same micro-batch would halve the global batch: refused before loading
        r = run([PY, "recipes/sft.py", rec, "training.resume_from_checkpoint=true"], timeout=300)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "was trained with 4 examples per step (2 ranks x per_device_train_batch_size 2" in r.stderr
        assert "so that the product is 4" in r.stderr and not os.path.exists(out / "model.safetensors")
    r = run(launch(strategy, "recipes/sft.py", [rec, "training.resume_from_checkpoint=true",
                                                "training.per_device_train_batch_size=4"], processes=1),
            timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == 1 and info["global_step"] == STEPS
    assert r.stdout.count("{'loss': ") == STEPS - 4
    diff = within("resume.other_world_size.weights", *common(weights(out), weights(ref)),
                  label=f"{strategy}, 2 ranks -> 1")
    print(f"{strategy}: 2-rank checkpoint-4 resumed on 1 rank: relative error to the 2-rank run {diff:.3g}")


@pytest.mark.parametrize("strategy,written,resumed", [("zero3", 2, 1), ("zero2", 2, 1), ("zero3", 1, 2)])
def test_zero_checkpoint_resumes_on_another_world_size_through_a_universal_checkpoint(
        strategy, written, resumed, tmp_path, tiny_model_dir, references):
    """ZeRO partitions the optimizer per rank: checkpoint-4 of a run on `written` ranks is converted to DeepSpeed's
    universal format on resume by `resumed` ranks (same global batch of 4) and gives the first run's weights."""
    if written == 2:
        ref = references(strategy)
    else:
        ref = tmp_path / "ref"
        r = run(launch(strategy, "recipes/sft.py", [recipe(tmp_path, tiny_model_dir, ref, name="ref.yaml"),
                                                    "training.per_device_train_batch_size=4"], processes=1),
                timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    shutil.copytree(ref / "checkpoint-4", out / "checkpoint-4")
    r = run(launch(strategy, "recipes/sft.py", [recipe(tmp_path, tiny_model_dir, out),
                                                "training.resume_from_checkpoint=true",
                                                f"training.per_device_train_batch_size={4 // resumed}"],
                   processes=resumed), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "was written by another number of ranks: resuming from its universal checkpoint" in r.stdout
    assert (out / "checkpoint-4" / "latest_universal").read_text() == "global_step4_universal"
    # The conversion is recorded in the checkpoint's manifest: a later resume verifies it, files and all.
    assert manifest_problems(str(out / "checkpoint-4")) == []
    assert "latest_universal" in read_manifest(str(out / "checkpoint-4"))
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == resumed and info["zero_stage"] == int(strategy[-1]) and info["global_step"] == STEPS
    assert r.stdout.count("{'loss': ") == STEPS - 4
    diff = within("resume.other_world_size.weights", *common(weights(out), weights(ref)),
                  label=f"{strategy}, {written} ranks -> {resumed} (universal)")
    print(f"{strategy}: {written}-rank checkpoint-4 resumed on {resumed} (universal): relative error to ref {diff:.3g}")


def test_one_rank_checkpoint_resumes_on_two_ranks(tmp_path, tiny_model_dir):
    """And back: a 1-process DDP run with micro-batch 4, its checkpoint-4 resumed by 2 ranks x 2: same weights."""
    ref = tmp_path / "ref"
    r = run([PY, "recipes/sft.py", recipe(tmp_path, tiny_model_dir, ref, name="ref.yaml"),
             "training.per_device_train_batch_size=4"], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    shutil.copytree(ref / "checkpoint-4", out / "checkpoint-4")
    r = run(launch("ddp", "recipes/sft.py", [recipe(tmp_path, tiny_model_dir, out),
                                             "training.resume_from_checkpoint=true"]), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    info = json.load(open(out / "run_info.json"))
    assert info["world_size"] == 2 and info["global_step"] == STEPS
    assert r.stdout.count("{'loss': ") == STEPS - 4
    diff = within("resume.other_world_size.weights", *common(weights(out), weights(ref)), label="ddp, 1 rank -> 2")
    print(f"ddp: 1-rank checkpoint-4 resumed on 2 ranks: relative error to the 1-rank run {diff:.3g}")


def test_fsdp_damaged_optimizer_shard_is_refused_then_resumed_weights_only(tmp_path, tiny_model_dir, references):
    """FSDP2's sharded state (optimizer_0/*.distcp, written by every rank into the staged folder) is in the manifest:
    a damaged optimizer shard is refused by name, writing nothing; training.resume_weights_only loads the weights
    (pytorch_model_fsdp_0/) and trains on with a fresh optimizer."""
    ref = references("fsdp")
    out = tmp_path / "out"
    shutil.copytree(ref / "checkpoint-4", out / "checkpoint-4")
    shard = sorted((out / "checkpoint-4" / "optimizer_0").glob("*.distcp"))[-1]
    with open(shard, "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        fh.write(b"\x00\x01\x02")
    cmd = launch("fsdp", "recipes/sft.py", [recipe(tmp_path, tiny_model_dir, out),
                                            "training.resume_from_checkpoint=true",
                                            "training.per_device_train_batch_size=4"], processes=1)
    r = run(cmd, timeout=600)
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]  # the worker exits 2, the launcher 1
    assert f"checkpoint-4/optimizer_0/{shard.name}: sha256 differs from the manifest" in r.stderr, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["checkpoint-4"]  # nothing written
    r = run([*cmd[:-1], "training.resume_weights_only=true", cmd[-1]], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hftrain: resuming the weights only from" in r.stdout
    assert r.stdout.count("{'loss': ") == STEPS - 4
    assert json.load(open(out / "run_info.json"))["global_step"] == STEPS


def test_chaos_kill_the_launcher_at_random_points_then_finish_equals_uninterrupted(tmp_path, tiny_model_dir,
                                                                                   references):
    """SIGKILL only the launcher (not its process group) at random moments, several times in one run: during the
    start-up, a step, a checkpoint save. After each kill no process of the run survives (the workers end with their
    launcher), and the next launch continues from what is there: the newest verified checkpoint when there is one,
    else from scratch. The run finished this way has the weights of an uninterrupted one."""
    import random

    rng = random.Random(20261123)  # fixed: the same "random" points on every run of the suite
    ref = references("ddp")
    out = tmp_path / "out"
    path = recipe(tmp_path, tiny_model_dir, out, save_steps=1)  # a save every step: kills land in saves too
    kills, history = 0, []
    for attempt in range(8):
        last = newest_complete(str(out)) if out.exists() else None
        done = int(last.rsplit("-", 1)[1]) if last else 0
        args = [path] + (["training.resume_from_checkpoint=true"] if last else [])
        proc = start_slow(launch("ddp", "tests/slow_sft.py", args), sleep=0.5)
        if kills < 4 and done + 1 < STEPS:
            if attempt == 0:  # in the start-up: loading, tokenising, the process group, the first step
                # At a random moment, but no later than checkpoint-1's publication: a fast start-up must still leave
                # room for the later kills (once seen: the kill landed after checkpoint-3 of 6, 2 kills in all).
                deadline = time.monotonic() + rng.uniform(1, 4)
                while time.monotonic() < deadline and not os.path.isdir(os.path.join(out, "checkpoint-1")):
                    time.sleep(0.05)
                where = "start-up" if not os.path.isdir(os.path.join(out, "checkpoint-1")) else "after checkpoint-1"
            else:  # once checkpoint-N is published, a moment later: in step N+1 or in its save
                target = min(done + rng.choice([1, 2]), STEPS - 1)
                wait_for(os.path.join(out, f"checkpoint-{target}"), proc)
                time.sleep(rng.uniform(0, 0.8))
                where = f"after checkpoint-{target}"
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: its workers must follow it by themselves
                proc.wait(timeout=60)
                kills += 1
                assert_no_process_left(str(tmp_path) + os.sep, within=60)
                now = newest_complete(str(out)) if out.exists() else None
                history.append(f"killed {where}; newest complete checkpoint: {os.path.basename(now or '-')}")
                continue
        text = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, text[-4000:]
        history.append(f"finished (attempt {attempt + 1})")
        break
    else:
        raise AssertionError(f"the run never finished: {history}")
    print("\n".join(history))
    assert kills >= 3, history  # the chaos really happened
    assert_no_process_left(str(tmp_path) + os.sep, within=60)
    state = json.load(open(out / "trainer_state.json"))
    assert [h["step"] for h in state["log_history"] if "loss" in h][-1] == STEPS
    diff = within("resume.killed_vs_uninterrupted.weights", *common(weights(out), weights(ref)),
                  label=f"ddp, chaos: {kills} kills")
    print(f"chaos: {kills} kills, relative error to uninterrupted {diff:.3g}")
