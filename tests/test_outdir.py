"""output_dir ownership: a finished, unfinished or foreign folder is refused unless resuming or overwriting, and the
lock makes a second run into a folder in use fail naming the first."""

import os
import subprocess
import sys
import textwrap

import pytest

from hftrain import outdir
from hftrain.errors import LaunchError


def _touch(path, text="x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


@pytest.mark.parametrize("files, state", [
    ([], "new"),
    (["ddp.yaml"], "new"),  # hftrain config / hftrain launch rendered its configs there
    (["zero3.yaml", "zero3.json"], "new"),
    (["recipe.yaml"], "new"),  # stopped before its first checkpoint: nothing to lose
    (["recipe.yaml", "_incomplete/checkpoint-5/x"], "new"),  # a save cut short was never a checkpoint
    (["checkpoint-10/trainer_state.json"], "unfinished"),
    (["recipe.yaml", "model.safetensors", "run_info.json"], "finished"),
    (["notes.txt"], "foreign"),
    (["ddp.yaml", "data.jsonl"], "foreign"),
])
def test_run_state(tmp_path, files, state):
    out = tmp_path / "run"
    out.mkdir()
    for f in files:
        _touch(str(out / f))
    assert outdir.run_state(str(out))[0] == state


def test_missing_folder_is_new(tmp_path):
    assert outdir.run_state(str(tmp_path / "absent")) == ("new", [])
    assert outdir.ownership_problem(str(tmp_path / "absent"), resume=False, overwrite=False) is None


@pytest.mark.parametrize("files, resume, overwrite, refused", [
    (["run_info.json"], False, False, "holds a finished run"),
    (["run_info.json"], True, False, None),
    (["run_info.json"], False, True, None),
    (["checkpoint-3/trainer_state.json"], False, False, "did not finish"),
    (["checkpoint-3/trainer_state.json"], True, False, None),
    (["notes.txt"], False, False, "files hftrain did not write (notes.txt)"),
    (["notes.txt"], True, False, "files hftrain did not write"),  # resume does not adopt a foreign folder
    (["notes.txt"], False, True, None),
])
def test_ownership(tmp_path, files, resume, overwrite, refused):
    for f in files:
        _touch(str(tmp_path / f))
    problem = outdir.ownership_problem(str(tmp_path), resume=resume, overwrite=overwrite)
    if refused is None:
        assert problem is None
    else:
        assert problem.startswith("training.output_dir: ") and refused in problem
        assert "overwrite_output_dir" in problem


HOLD = textwrap.dedent("""
    import sys, time
    from hftrain import outdir
    outdir.claim(sys.argv[1], overwrite=False, resumed=False)
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.mark.launches
def test_lock_names_the_holder_and_is_released_when_it_dies(tmp_path):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", HOLD, out], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        problem = outdir.ownership_problem(out, resume=True, overwrite=True)
        assert problem and "in use by another run" in problem and f"pid {p.pid}" in problem
        with pytest.raises(LaunchError, match=f"pid {p.pid}"):
            outdir.claim(out, overwrite=True, resumed=True)
    finally:
        p.kill()
        p.wait()
    assert outdir.holder(out) is None  # the kernel released it with the process (SIGKILL included)
    outdir.claim(out, overwrite=False, resumed=False)
    try:
        assert f"pid {os.getpid()}" in open(os.path.join(out, outdir.LOCK_FILE)).read()
        assert outdir.holder(out) is None  # our own lock does not refuse our own checks
    finally:
        outdir.release(out)


def test_overwrite_clears_the_previous_run_and_keeps_other_files(tmp_path):
    for f in ["checkpoint-5/trainer_state.json", "checkpoint-10/trainer_state.json", "_incomplete/checkpoint-15/a",
              "run_info.json", "recipe.yaml", "model.safetensors", "keep.txt"]:
        _touch(str(tmp_path / f))
    said = []
    outdir.claim(str(tmp_path), overwrite=True, resumed=False, say=said.append)
    try:
        left = sorted(os.listdir(tmp_path))
        assert left == [".hftrain.lock", "keep.txt", "model.safetensors", "recipe.yaml"]
        assert said and "checkpoint-10" in said[0] and "run_info.json" in said[0]
    finally:
        outdir.release(str(tmp_path))


def test_resume_with_overwrite_keeps_the_checkpoints(tmp_path):
    _touch(str(tmp_path / "checkpoint-5/trainer_state.json"))
    outdir.claim(str(tmp_path), overwrite=True, resumed=True)
    try:
        assert os.path.isdir(tmp_path / "checkpoint-5")
    finally:
        outdir.release(str(tmp_path))


# -- claim, then check, under the lock (issue 33, point 2) ------------------------------------------------------------
FINISHED = ["recipe.yaml", "model.safetensors", "run_info.json", "checkpoint-2/trainer_state.json", ".hftrain.lock"]


def test_claim_checks_the_folder_again_under_the_lock(tmp_path):
    """The preflight saw a new folder; another run finished there before this one claimed it: refused at the claim,
    and the claim leaves the other run's folder exactly as it was (its lock file included)."""
    out = tmp_path / "run"
    assert outdir.ownership_problem(str(out), resume=False, overwrite=False) is None  # the preflight's view
    for f in FINISHED:
        _touch(str(out / f), f)
    before = {f: open(out / f).read() for f in FINISHED}
    with pytest.raises(LaunchError, match="holds a finished run"):
        outdir.claim(str(out), overwrite=False, resumed=False)
    assert sorted(os.listdir(out)) == sorted({f.split("/")[0] for f in FINISHED})
    assert {f: open(out / f).read() for f in FINISHED} == before
    assert outdir.holder(str(out)) is None and str(out) not in outdir._held


def test_a_refused_claim_removes_the_lock_file_and_folder_it_made(tmp_path):
    out = tmp_path / "run"
    _touch(str(out / "notes.txt"))
    with pytest.raises(LaunchError, match="files hftrain did not write"):
        outdir.claim(str(out), overwrite=False, resumed=False)
    assert os.listdir(out) == ["notes.txt"]  # no .hftrain.lock left in a folder that is not ours
    with pytest.raises(LaunchError, match="your home folder"):
        outdir.claim(os.path.expanduser("~"), overwrite=True, resumed=False)
    assert not os.path.exists(os.path.join(os.path.expanduser("~"), outdir.LOCK_FILE))


def test_overwrite_removes_numbered_checkpoints_only(tmp_path):
    for f in ["checkpoint-5/trainer_state.json", "checkpoint-notes/mine.txt", "run_info.json"]:
        _touch(str(tmp_path / f))
    outdir.claim(str(tmp_path), overwrite=True, resumed=False, say=lambda _m: None)
    try:
        assert sorted(os.listdir(tmp_path)) == [".hftrain.lock", "checkpoint-notes"]
    finally:
        outdir.release(str(tmp_path))
