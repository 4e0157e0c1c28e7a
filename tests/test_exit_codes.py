"""How a run ends when it is stopped (issue 33, point 8): Ctrl-C (SIGINT) ends `python recipes/sft.py` with status
130 and SIGTERM with 143, one line each and no traceback (the status a shell shows for a process those signals end,
as the README says); a worker's user error ends `hftrain launch` with the worker's status 2, its one message and
torch's failure summary, no traceback. `hftrain launch` stopped by a signal: tests/test_workers.py."""

import os
import signal
import subprocess
import time

import pytest
import yaml

from .conftest import DEMO_TRAIN, PY, REPO, run

pytestmark = pytest.mark.launches


def _recipe(tmp, model_dir, **training) -> str:
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump({
        "model": {"name_or_path": model_dir, "dtype": "float32"},
        "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 32},
        "training": {"output_dir": str(tmp / "out"), "max_steps": 200, "save_steps": 2,
                     "per_device_train_batch_size": 2, "logging_steps": 1, "report_to": "none", "disable_tqdm": True,
                     **training}}))
    return str(p)


# The run is started with SIGINT at its default disposition, as a terminal's foreground job is: a suite started as a
# background job of a non-interactive shell (`pytest ... &`) ignores SIGINT, every process it starts inherits SIG_IGN,
# and Python then installs no KeyboardInterrupt handler: the run trained on after Ctrl-C (seen in issue 55's full runs,
# passing when run in the foreground; the cause found in issue 56's session).
def _sigint_as_a_terminal_has_it():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_recipe_script_stopped_by_a_signal_exits_128_plus_n_in_one_line(sig, tmp_path, tiny_model_dir):
    """Sent as a terminal sends Ctrl-C: to the run's whole process group, mid-training."""
    # PYTHONFAULTHANDLER: a run that has not ended is sent SIGABRT, and every thread's stack is in the failure
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HFTRAIN_TEST_STEP_SLEEP="0.3",
               PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen([PY, "tests/slow_sft.py", _recipe(tmp_path, tiny_model_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_sigint_as_a_terminal_has_it)
    lines, t0 = [], time.time()
    try:
        for line in proc.stdout:
            lines.append(line)
            if "{'loss': " in line:
                break
            assert time.time() - t0 < 300, "".join(lines)[-3000:]
        os.killpg(proc.pid, sig)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # seen once in a full run under load: say where it hangs
            os.killpg(proc.pid, signal.SIGABRT)
            stacks, _ = proc.communicate(timeout=30)
            raise AssertionError(f"still running 60 s after {sig.name}; its threads:\n" + stacks[-8000:]) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + sig, f"status {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    name = "SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM"
    assert out.count(f"hftrain: stopped by {name};") == 1, out[-3000:]
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_hftrain_launch_ends_with_its_workers_user_error_status_without_a_traceback(tmp_path, tiny_model_dir):
    """A bad data row that only the workers' data phase sees: exit 2 (accelerate's own launcher said 1, with a
    traceback), the worker's one message, torch's summary naming the rank and its exit code."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n{oops\n')
    rec = _recipe(tmp_path, tiny_model_dir, max_steps=1)
    r = run([PY, "-m", "hftrain.cli", "launch", rec, f"data.sources.0.path={bad}", "strategy.num_processes=2"],
            timeout=300, real=True)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in out and f"{bad}:2: malformed JSON" in out, out[-3000:]
    assert "exitcode  : 2" in out, out[-3000:]  # torch elastic's summary of the failed rank
