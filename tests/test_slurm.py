"""SLURM for real (issue 30): the script `hftrain config --slurm` writes, submitted unmodified to a 2-node SLURM cluster
stood up on this machine (tests/slurm_cluster.py: slurmctld, two slurmd in two network namespaces), trains as 2
machines x 1 process; a job that reaches its time limit saves, is requeued and resumes to the numbers of 1 node x 2
processes; `scancel` mid-run leaves no process and a folder the next run accepts. Needs root (namespaces) and the
SLURM packages (installed when missing: scripts/install_slurm.sh); skipped with the reason otherwise. The rendering
itself and the address finder are tested without a cluster; SLURM's stop signal on plain processes in
test_stop_signals.py (no cluster: it runs beside other tests)."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from hftrain import hostaddr, outdir, stop_request
from hftrain.checkpoints import verify
from hftrain.cli import main

from .conftest import DEMO_TRAIN, PY, REPO

SLOW_SFT = os.path.join(REPO, "tests", "slow_sft.py")


def recipe(tmp, model_dir, out, machines=2, processes=2, **training) -> str:
    rec = {"model": {"name_or_path": model_dir, "dtype": "float32"},
           "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 64},
           "strategy": {"name": "ddp", "num_machines": machines, "num_processes": processes, "rank_timeout": 60,
                        **({"socket_ifname": "hf0"} if machines > 1 else {})},
           "training": {"output_dir": str(out), "max_steps": 6, "per_device_train_batch_size": 4,
                        "learning_rate": 3e-3, "logging_steps": 1, "save_strategy": "steps", "save_steps": 2,
                        "report_to": "none", "disable_tqdm": True, "seed": 0, "use_cpu": True, **training}}
    path = tmp / f"recipe-{machines}x{processes // machines}.yaml"
    path.write_text(yaml.safe_dump(rec))
    return str(path)


def render(rec: str, *args: str) -> str:
    assert main(["config", rec, "--slurm", *args]) == 0
    with open(rec) as fh:
        return os.path.join(yaml.safe_load(fh)["training"]["output_dir"], "launch.sbatch")


def losses(out) -> list[float]:
    with open(os.path.join(out, "trainer_state.json")) as fh:
        return [h["loss"] for h in json.load(fh)["log_history"] if "loss" in h]


def close(a: list[float], b: list[float], rel: float = 1e-6) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=0) for x, y in zip(a, b))


# -- rendering -------------------------------------------------------------------------------------------------


def test_the_script_names_everything_by_absolute_path_and_asks_for_gpus_only_when_the_run_uses_them(tmp_path,
                                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": {"name": "zero3", "num_machines": 4, "num_processes": 32,
                                                "socket_ifname": "ib0"},
                                   "training": {"output_dir": "runs/x"}}))
    assert main(["config", "r.yaml", "--slurm", "training.max_steps=5"]) == 0
    out = tmp_path / "runs" / "x"
    script = (out / "launch.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(out / "launch.sbatch")]).returncode == 0
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert f"#SBATCH --output={out / 'slurm'}/slurm-%j.out" in script and (out / "slurm").is_dir()
    assert f"#SBATCH --chdir={tmp_path}" in script  # the recipe's relative paths are relative to it
    assert "#SBATCH --signal=USR1@300" in script and "#SBATCH --requeue" in script
    assert f"PY={PY}" in script and "accelerate.commands.launch --config_file " + str(out / "zero3.yaml") in script
    assert f"-m hftrain.recipes.sft {tmp_path / 'r.yaml'} training.max_steps=5 strategy.name=zero3" in script
    assert "--num_machines 4 --num_processes 32" in script and '--machine_rank "$SLURM_NODEID"' in script
    assert "export GLOO_SOCKET_IFNAME=ib0" in script and "export NCCL_SOCKET_IFNAME=ib0" in script
    assert 'MAIN_ADDR=$("$PY" -m hftrain.hostaddr ib0)' in script
    # Requeued when the ranks say they stopped on SIGUSR1 (a file in the log folder), not when the rendered folder
    # lacks run_info.json: an output_dir overridden after the script finished there and was requeued forever.
    assert 'export HFTRAIN_STOP_MARKER="$OUT/slurm/stopped-$SLURM_JOB_ID"' in script
    assert 'if [ "$status" = 0 ] && [ -e "$HFTRAIN_STOP_MARKER" ]; then' in script and "run_info.json" not in script
    assert not re.search(r"(^|[\s'\"])accelerate launch ", script)  # nothing found through PATH or the cwd
    assert "recipes/sft.py" not in script
    # A CPU run asks for no GPU: nodes without a gpu GRES could never run the job.
    assert main(["config", "r.yaml", "--slurm", "training.use_cpu=true", "strategy.socket_ifname=null"]) == 0
    script = (out / "launch.sbatch").read_text()
    assert "--gpus-per-node" not in script and "GLOO_SOCKET_IFNAME" not in script
    assert 'MAIN_ADDR=$("$PY" -m hftrain.hostaddr)' in script
    # What `hftrain config --slurm` wrote is not a run: a run into the folder is not refused.
    assert outdir.run_state(str(out)) == ("new", [])
    # One node: the ranks meet on loopback (hostaddr refuses a hostname that resolves to one, as it must for several)
    assert main(["config", "r.yaml", "--slurm", "strategy.num_machines=1", "strategy.num_processes=8"]) == 0
    script = (out / "launch.sbatch").read_text()
    assert "MAIN_ADDR=127.0.0.1\n" in script and "hftrain.hostaddr" not in script
    assert subprocess.run(["bash", "-n", str(out / "launch.sbatch")]).returncode == 0


def test_rendering_never_rewrites_the_config_a_run_wrote_for_itself(tmp_path, monkeypatch, capsys):
    """A finished run's folder holds the accelerate config the run rendered for itself: `hftrain config` into it
    refuses to change it (issue 43) and names --output; the same config is rendered (nothing changes)."""
    monkeypatch.chdir(tmp_path)
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": {"name": "fsdp", "num_processes": 2},
                                   "training": {"output_dir": "out"}}))
    assert main(["config", "r.yaml"]) == 0
    out = tmp_path / "out"
    (out / "run_info.json").write_text("{}")  # the run finished there
    written = (out / "fsdp.yaml").read_bytes()
    assert main(["config", "r.yaml", "--slurm"]) == 0  # what it renders is what the run wrote: nothing changes
    with pytest.raises(SystemExit) as e:
        main(["config", "r.yaml", "--slurm", "strategy.fsdp_offload_params=true"])
    assert e.value.code == 2 and (out / "fsdp.yaml").read_bytes() == written
    assert (f"{out} holds a run, and rendering there would rewrite the launcher config it wrote for itself "
            f"({out / 'fsdp.yaml'}): render into another folder with --output DIR") in capsys.readouterr().err
    assert main(["config", "r.yaml", "--slurm", "--output", "elsewhere", "strategy.fsdp_offload_params=true"]) == 0


def test_torchrun_and_deepspeed_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": {"name": "ddp", "num_machines": 2, "num_processes": 16},
                                   "training": {"output_dir": "out"}}))
    assert main(["config", "r.yaml", "--slurm", "--launcher", "torchrun"]) == 0
    script = (tmp_path / "out" / "launch.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "out" / "launch.sbatch")]).returncode == 0
    assert ('-m torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint '
            '"$MAIN_ADDR:29500" --rdzv-id "hftrain-$SLURM_JOB_ID"') in script
    assert '--rdzv-conf "is_host=$(( SLURM_NODEID == 0 ))" --local-addr "$("$PY" -m hftrain.hostaddr)"' in script
    with pytest.raises(SystemExit) as e:  # DeepSpeed's launcher: ZeRO strategies only
        main(["config", "r.yaml", "--slurm", "--launcher", "deepspeed"])
    assert e.value.code == 2
    assert main(["config", "r.yaml", "--slurm", "--launcher", "deepspeed", "strategy.name=zero2"]) == 0
    script = (tmp_path / "out" / "launch.sbatch").read_text()
    assert 'sed "s/$/ slots=8/" > "$HOSTFILE"' in script
    assert ('-m deepspeed.launcher.runner --hostfile "$HOSTFILE" --no_ssh --master_addr "$MAIN_ADDR" --master_port '
            '29500 --no_local_rank') in script and '--node_rank "$SLURM_NODEID"' in script
    assert "--module hftrain.recipes.sft" in script
    with pytest.raises(SystemExit):
        main(["config", "r.yaml", "--slurm", "--launcher", "torchrun", "strategy.name=fsdp"])
    with pytest.raises(SystemExit):  # not silently ignored without --slurm
        main(["config", "r.yaml", "--launcher", "torchrun"])


@pytest.mark.parametrize("section, module", [({}, "sft"), ({"preference": {}}, "dpo"),
                                             ({"grpo": {"rewards": [{"function": "exact_match"}]}}, "grpo")])
def test_the_job_runs_the_recipes_own_method(tmp_path, monkeypatch, section, module):
    """A GRPO recipe's job started the SFT script (issue 43): the job runs the recipe's method, as `hftrain launch`."""
    monkeypatch.chdir(tmp_path)
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d"}]},
                                   "strategy": {"name": "ddp", "num_machines": 2, "num_processes": 4},
                                   "training": {"output_dir": "out"}, **section}))
    assert main(["config", "r.yaml", "--slurm"]) == 0
    script = (tmp_path / "out" / "launch.sbatch").read_text()
    assert f"-m hftrain.recipes.{module} {rec}" in script
    assert [m for m in ("sft", "dpo", "grpo") if f"hftrain.recipes.{m} " in script] == [module]


def test_the_main_address_is_one_the_other_machines_reach(monkeypatch):
    assert hostaddr.interface_address("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="no IPv4 address on interface 'nosuch0'"):
        hostaddr.reachable_address("nosuch0")
    # A hostname that resolves to loopback only (Debian's 127.0.1.1): refused, naming the fix.
    monkeypatch.setattr(hostaddr, "_resolved", lambda host: ["127.0.1.1"])
    with pytest.raises(ValueError, match="resolves to 127.0.1.1, which the other machines cannot reach; set "
                                         "strategy.socket_ifname"):
        hostaddr.reachable_address()
    assert hostaddr.main([]) == 2
    monkeypatch.setattr(hostaddr, "_resolved", lambda host: ["127.0.1.1", "10.1.2.3"])
    assert hostaddr.reachable_address() == "10.1.2.3"


# -- the stop request on one process ----------------------------------------------------------------------------


def _run(argv, env=None, timeout=300):
    return subprocess.run([PY, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})


def test_the_request_is_recorded_not_fatal():
    stop_request.clear()
    assert stop_request.arm()
    os.kill(os.getpid(), signal.SIGUSR1)  # its default action would end this process
    time.sleep(0.1)
    assert stop_request.requested()
    stop_request.clear()
    assert not stop_request.requested()


# -- a real cluster ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    from tests import slurm_cluster

    why = slurm_cluster.problem()
    if why:
        pytest.skip(why)
    with slurm_cluster.cluster() as c:
        yield c


def _published(out) -> list[str]:
    return sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1])) \
        if os.path.isdir(out) else []


def _log(out, job) -> str:
    path = os.path.join(out, "slurm", f"slurm-{job}.out")
    return open(path, errors="replace").read() if os.path.exists(path) else "(no log)"


def _seconds(runtime: str) -> int:
    """SLURM's [days-]HH:MM:SS in seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, sec = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


def _wait_for(predicate, timeout, what, cluster=None):
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}\n{cluster.logs() if cluster else ''}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def one_node(cluster, tiny_model_dir, tmp_path_factory) -> list[float]:
    """The reference: the script rendered for 1 node x 2 processes, submitted; its losses. Rendered in torchrun's
    form (c10d rendezvous hosted by the first node): the launcher changes no number."""
    tmp = tmp_path_factory.mktemp("one_node")
    out = tmp / "out"
    job = cluster.sbatch(render(recipe(tmp, tiny_model_dir, out, machines=1, processes=2, max_steps=12),
                                "--launcher", "torchrun"))
    info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 300)
    assert info["JobState"] == "COMPLETED", _log(out, job)
    return losses(out)


@pytest.mark.launches
@pytest.mark.cluster
def test_a_job_at_its_time_limit_saves_is_requeued_and_resumes_to_the_one_node_result(cluster, one_node,
                                                                                      tiny_model_dir, tmp_path):
    """2 nodes x 1 process, the script as rendered. Once training runs, the job's time limit is brought near (as a
    long run reaches it): SLURM signals, every rank stops after the same step with a checkpoint, the script requeues
    the job, the requeued job resumes from it and finishes: world size 2, losses of 1 node x 2 processes."""
    out = tmp_path / "out"
    # Rendered for one folder, the run moved by an override after the script (issue 43: the script looked for the
    # final save in the rendered folder and requeued a finished run again and again).
    rendered = tmp_path / "rendered"
    rec = recipe(tmp_path, tiny_model_dir, rendered, max_steps=12)
    script = render(rec, "--script", SLOW_SFT)
    t0 = time.monotonic()
    # 5 s per step before the requeue (none after): 50 s of training left after checkpoint-2 for the signal to come.
    job = cluster.sbatch(script, f"training.output_dir={out}",
                         env={"HFTRAIN_TEST_STEP_SLEEP": "5", "HFTRAIN_TEST_SLEEP_UNTIL_RESTART": "1"})
    _wait_for(lambda: _published(out) or cluster.job(job)["JobState"] not in ("PENDING", "RUNNING"), 300,
              "the first checkpoint", cluster)
    assert _published(out), _log(rendered, job)
    # The time limit (whole minutes) set so that its end is 60-120 s away: the signal (300 s ahead) comes at
    # slurmctld's next time-limit pass (every 30 s), the kill no earlier than 60 s from now.
    ran = _seconds(cluster.job(job)["RunTime"])
    cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={math.ceil((ran + 60) / 60)}")
    _wait_for(lambda: int(cluster.job(job).get("Restarts", 0)) >= 1, 120, "the requeue", cluster)
    # The requeued job would keep the short limit, and get the signal at once: give it the usual allowance back.
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=UNLIMITED")
    info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 300)
    log = _log(rendered, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    assert not (rendered / "run_info.json").exists() and log.count("requeueing job") == 1, log[-4000:]
    stopped = int(log.split("every rank stopped after step ")[1].split()[0])
    assert 2 <= stopped < 12 and "requeueing job" in log, log[-4000:]
    assert f"the job was requeued by SLURM: resuming from {out}/checkpoint-{stopped}" in log, log[-4000:]
    run_info = json.load(open(out / "run_info.json"))
    assert run_info["world_size"] == 2 and run_info["wrapper"] == "DistributedDataParallel"
    assert close(losses(out), one_node), (losses(out), one_node)
    for ckpt in _published(out):
        verify(str(out / ckpt))
    print(f"stopped after step {stopped}; job done in {time.monotonic() - t0:.0f} s")


@pytest.mark.launches
@pytest.mark.cluster
def test_scancel_mid_run_leaves_no_process_and_a_folder_the_next_run_accepts(cluster, tiny_model_dir, tmp_path,
                                                                             deepspeed_ops):
    """Rendered in DeepSpeed's launcher form (a hostfile from the allocation, `--no_ssh --node_rank`), ZeRO-2 on 2
    nodes x 1 process: it trains to a checkpoint; scancel then ends every process on both nodes (DeepSpeed's runner,
    its node launcher, the workers), the lock goes, every checkpoint verifies, and the next run accepts the folder."""
    out = tmp_path / "out"
    rec = recipe(tmp_path, tiny_model_dir, out, max_steps=200)
    job = cluster.sbatch(render(rec, "--script", SLOW_SFT, "--launcher", "deepspeed", "strategy.name=zero2"),
                         env={"HFTRAIN_TEST_STEP_SLEEP": "0.5"})
    _wait_for(lambda: _published(out) or cluster.job(job)["JobState"] not in ("PENDING", "RUNNING"), 300,
              "the first checkpoint", cluster)
    assert _published(out) and all(cluster.node_pids().values()), _log(out, job)
    cluster.run("scancel", str(job))
    t0 = time.monotonic()
    cluster.wait_state(job, {"CANCELLED"}, 60)
    _wait_for(lambda: not any(cluster.node_pids().values()), 30, "every process of the job to end")
    gone = time.monotonic() - t0
    assert outdir.holder(str(out)) is None  # the lock went with its holder
    for ckpt in _published(out):
        verify(str(out / ckpt))
    # The next run accepts the folder: `hftrain check` is the run's own validation (output_dir, resume, checkpoint).
    r = _run(["-m", "hftrain.cli", "check", rec, "strategy.name=zero2", "training.resume_from_checkpoint=true",
              "--no-data"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    print(f"scancel: every process gone within {gone:.1f} s; published {_published(out)}")
    shutil.rmtree(out, ignore_errors=True)
