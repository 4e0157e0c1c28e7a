"""tests/forked.py, the preloaded launches most 2-rank tests run on, against real ones: the ranks it forks get the
environment accelerate's launch and torchrun give theirs (the scripts they run are the same code either way), a failed
rank fails the launch, and what a library reads at import sends a launch to a real process."""

import json
import os
import subprocess

import pytest

from tests.support import LaunchTimedOut, free_port

from .conftest import ACCELERATE_LAUNCH, PY, REPO, run

# What torchrun sets only through its agent, or differs by launch: not compared.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
              "TORCHELASTIC_AGENT_PID", "PYTHONPATH", "_", "OLDPWD", "PWD", "PYTEST_CURRENT_TEST",
              # left set by accelerate's CUDA probe in a real launcher whose imports ran it (the server's ran it
              # earlier); it only chooses how torch asks whether CUDA is there
              "PYTORCH_NVML_BASED_CUDA_CHECK"}
DUMP = """import json, os, sys
rank = os.environ["RANK"]
with open(f"{sys.argv[1]}.{rank}.json", "w") as fh:
    json.dump(dict(os.environ), fh)
sys.exit(int(sys.argv[2]) if rank == "1" else 0)
"""


def dump_env(tmp_path, name: str, forked: bool, rank1_exit: int = 0) -> tuple[subprocess.CompletedProcess, list]:
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP)
    cmd = [*ACCELERATE_LAUNCH, "--config_file", os.path.join(REPO, "accelerate_configs/zero3.yaml"),
           "--main_process_port", str(free_port()), str(script), str(tmp_path / name), str(rank1_exit)]
    r = run(cmd, timeout=120, real=not forked)
    envs = []
    for rank in (0, 1):
        path = tmp_path / f"{name}.{rank}.json"
        envs.append(json.load(open(path)) if path.exists() else None)
    return r, envs


@pytest.mark.launches
def test_forked_ranks_get_the_environment_of_a_real_launch(tmp_path):
    """ZeRO-3's shipped config (the most variables: DeepSpeed's and accelerate's): every variable a real
    `accelerate launch` gives each rank, with the same value, and none more."""
    real, real_envs = dump_env(tmp_path, "real", forked=False)
    fork, fork_envs = dump_env(tmp_path, "forked", forked=True)
    assert real.returncode == 0 and fork.returncode == 0, (real.stderr[-2000:], fork.stderr[-2000:])
    for rank, (a, b) in enumerate(zip(real_envs, fork_envs)):
        a = {k: v for k, v in a.items() if k not in PER_LAUNCH}
        b = {k: v for k, v in b.items() if k not in PER_LAUNCH}
        assert a == b, (rank, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
        assert a["RANK"] == str(rank) and a["ACCELERATE_USE_DEEPSPEED"] == "true"


@pytest.mark.launches
def test_a_failed_forked_rank_fails_the_launch_like_torchrun(tmp_path):
    r, envs = dump_env(tmp_path, "failed", forked=True, rank1_exit=3)
    assert r.returncode == 1 and "rank 1 exited with status 3" in r.stderr, r.stderr[-2000:]
    assert envs[0] is not None and envs[1] is not None


def test_what_is_read_at_import_gets_a_real_process():
    from tests import forked

    env = dict(os.environ)
    assert forked.forkable([PY, "x.py"], env) and forked.forkable([PY, "x.py"], dict(env, TORCH_EXTENSIONS_DIR="/x"))
    assert not forked.forkable([PY, "x.py"], dict(env, HF_HOME="/elsewhere"))
    assert not forked.forkable(["hftrain", "sft", "x.yaml"], env)


@pytest.mark.launches
@pytest.mark.parametrize("forked", [True, False])
def test_a_launch_past_its_time_out_says_what_it_was_doing(tmp_path, forked):
    """The time-out names the launch's processes as they were (a sleeping child here), the output so far and the
    build locks, and leaves none of its processes behind (a CI time-out once said only the command)."""
    script = tmp_path / "stuck.py"
    script.write_text("import subprocess, sys\nprint('before the wait', flush=True)\n"
                      "subprocess.run(['sleep', '1234'])\n")
    (tmp_path / "ext" / "async_io").mkdir(parents=True)
    (tmp_path / "ext" / "async_io" / "lock").write_text("")
    with pytest.raises(LaunchTimedOut) as caught:
        run([PY, str(script)], timeout=8, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, real=not forked)
    told = str(caught.value)
    assert "sleep 1234" in told and "before the wait" in told, told
    assert f"{tmp_path / 'ext' / 'async_io' / 'lock'} (" in told, told
    left = subprocess.run(["pgrep", "-f", "sleep 1234"], capture_output=True, text=True).stdout
    assert not left.strip(), left
