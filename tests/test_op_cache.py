"""DeepSpeed's op cache and the build locks a stopped build leaves in it (hftrain/launch/op_cache.py).

torch's JIT build takes `<op>/lock` and every other process waits for the file to go, with no time-out: a build
killed mid-way (a test's time-out did it in one CI, and its lock failed every ZeRO run of the next) would hang every
later run before training. A ZeRO run releases the locks no build holds, before its ops load and while it waits; the
locks of a build that may still be going are kept."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from hftrain.config import StrategySection
from hftrain.launch import op_cache, setup
from hftrain.launch.op_cache import LOCAL_STALE_LOCK_S, STALE_LOCK_S, on_local_filesystem, release_abandoned_build_locks
from hftrain.launch.strategy_checks import machine_strategy_problems
from hftrain.methods import load_recipe

OLD = STALE_LOCK_S + 5 * 60  # 20 min


def op_folder(root, name: str, age_s: float, written_s: float | None = None) -> str:
    """`root/name` holding a build's files and its lock, all dated `age_s` ago; one object file dated `written_s` ago
    where given (a build still writing)."""
    folder = root / name
    folder.mkdir()
    then = time.time() - age_s
    for file in ("build.ninja", "adam.o", "lock"):
        (folder / file).touch()
        os.utime(folder / file, (then, then))
    if written_s is not None:
        os.utime(folder / "adam.o", (time.time() - written_s,) * 2)
    return str(folder / "lock")


@pytest.fixture
def op_cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def test_on_a_local_disk_a_lock_no_process_builds_under_is_released_after_a_minute(op_cache_dir):
    stopped = op_folder(op_cache_dir, "cpu_adam", age_s=LOCAL_STALE_LOCK_S + 30, written_s=5)
    young = op_folder(op_cache_dir, "async_io", age_s=5)  # torch starts ninja within a second or two of taking it
    assert release_abandoned_build_locks(str(op_cache_dir), local=True) == [(stopped, pytest.approx(90, abs=5))]
    assert not os.path.exists(stopped) and os.path.exists(young)


def test_on_a_shared_disk_only_a_lock_and_folder_both_quiet_for_15_min_are_released(op_cache_dir):
    """Another machine may be building there, unseen by /proc: only the folder's writes tell."""
    stopped = op_folder(op_cache_dir, "cpu_adam", age_s=OLD)
    writing = op_folder(op_cache_dir, "pin_memory", age_s=OLD, written_s=60)  # a long build, going on elsewhere
    recent = op_folder(op_cache_dir, "async_io", age_s=5 * 60)
    assert [lock for lock, _ in release_abandoned_build_locks(str(op_cache_dir), local=False)] == [stopped]
    assert os.path.exists(writing) and os.path.exists(recent)


@pytest.mark.skipif(not os.path.isdir("/proc/self/cwd"), reason="no /proc to see a process's working directory")
@pytest.mark.parametrize("local", [True, False])
def test_a_lock_whose_folder_a_process_works_in_is_kept(op_cache_dir, local):
    """ninja and the compiler run in the op's folder: a compile of one file may write nothing for minutes."""
    lock = op_folder(op_cache_dir, "cpu_adam", age_s=OLD)
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=os.path.dirname(lock))
    try:
        assert release_abandoned_build_locks(str(op_cache_dir), local=local) == [] and os.path.exists(lock)
    finally:
        compiler.kill()
        compiler.wait()
    assert [lock_ for lock_, _ in release_abandoned_build_locks(str(op_cache_dir), local=local)] == [lock]


@pytest.mark.parametrize("kind, local", [("ext4", True), ("xfs", True), ("overlay", True), ("nfs4", False),
                                         ("lustre", False), ("fuse.sshfs", False)])
def test_the_file_system_of_the_longest_mount_point_decides(tmp_path, kind, local):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/home /home {kind} rw 0 0\n"
                      "server:/home/me/other /home/me/other nfs rw 0 0\n")
    assert on_local_filesystem("/home/me/.cache/hftrain", str(mounts)) is local
    assert on_local_filesystem("/tmp/x", str(mounts)) is True
    assert on_local_filesystem("/home/me/other/x", str(mounts)) is False
    assert on_local_filesystem("/tmp/x", str(tmp_path / "absent")) is False  # unknown: judged as shared


@pytest.mark.skipif(not os.path.isdir("/proc/self/cwd"), reason="no /proc to see a process's working directory")
def test_a_run_started_just_after_its_launcher_was_killed_waits_for_the_orphaned_compiler_then_removes_the_lock(
        op_cache_dir, monkeypatch):
    """Killed workers leave ninja and the compiler finishing their step in the op's folder (seen with a SIGKILLed
    `hftrain launch`): the next run waits for them, says so, then removes the lock; torch never waits on it."""
    monkeypatch.setattr(op_cache, "LOCAL_STALE_LOCK_S", 1.0)
    monkeypatch.setattr(op_cache, "on_local_filesystem", lambda path: True)
    lock = op_folder(op_cache_dir, "cpu_adam", age_s=0)
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"], cwd=os.path.dirname(lock))
    said, t0 = [], time.monotonic()
    op_cache.settle_build_locks(str(op_cache_dir), said.append, poll_s=0.2, tell_after_s=0)
    assert compiler.wait() == 0 and time.monotonic() - t0 >= 2 and not os.path.exists(lock)
    assert [m.split(" ")[0] for m in said] == ["waiting", "removed"], said
    assert said[0].startswith(f"waiting for the DeepSpeed op build going on in {os.path.dirname(lock)}")
    assert said[1].startswith(f"removed DeepSpeed's op build lock {lock}: taken ")


def test_a_build_going_on_is_waited_for_and_its_lock_left_to_it(op_cache_dir):
    """Another run's build, alive: settling waits until that build releases its lock, and removes nothing."""
    lock = op_folder(op_cache_dir, "cpu_adam", age_s=0)
    threading.Timer(1.0, os.remove, [lock]).start()  # the build ends and releases its lock
    said, t0 = [], time.monotonic()
    op_cache.settle_build_locks(str(op_cache_dir), said.append, poll_s=0.2, tell_after_s=0)
    assert time.monotonic() - t0 >= 0.9 and [m.split(" ")[0] for m in said] == ["waiting"]


def test_a_zero_runs_set_up_releases_a_stopped_builds_lock_and_says_so(op_cache_dir, capsys):
    stopped = op_folder(op_cache_dir, "cpu_adam", age_s=OLD)
    setup.prepare_op_cache()
    assert not os.path.exists(stopped)
    out = capsys.readouterr().out
    assert f"hftrain: removed DeepSpeed's op build lock {stopped}: taken 20 min ago by a build that was stopped" in out


def test_the_preflight_leaves_a_stopped_builds_lock_to_the_run(op_cache_dir):
    """`hftrain check` does not refuse what the run mends: the lock is neither a problem nor removed by the check."""
    lock = op_folder(op_cache_dir, "cpu_adam", age_s=OLD)
    assert machine_strategy_problems(StrategySection(name="zero2")) == []
    assert os.path.exists(lock)


@pytest.mark.parametrize("name, released", [("zero2", True), ("zero3_offload", True), ("ddp", False)])
def test_a_zero_runs_set_up_releases_the_locks_before_its_ops_load(op_cache_dir, monkeypatch, name, released):
    monkeypatch.setattr(setup, "share_fp32_master_with_fp32_weights", lambda: None)  # a process-wide patch
    lock = op_folder(op_cache_dir, "cpu_adam", age_s=OLD)
    recipe = load_recipe(None, ["model.name_or_path=m", "data.sources.0.path=d", f"strategy.name={name}"])
    setup._prepare_strategy(recipe, StrategySection(name=name))
    assert os.path.exists(lock) != released


def test_the_op_build_compiles_through_ccache_where_it_is_installed_and_keeps_the_command(tmp_path):
    """ccache's masquerade folder goes first on the build's PATH (once), so `c++`, the compiler torch writes into each
    op's build.ninja, is ccache's and the command ninja compares is unchanged; without ccache nothing changes."""
    from scripts.build_deepspeed_ops import compile_through_ccache

    masquerade = tmp_path / "ccache"
    environ = {"PATH": "/usr/local/bin:/usr/bin"}
    assert not compile_through_ccache(environ, str(masquerade)) and environ == {"PATH": "/usr/local/bin:/usr/bin"}
    masquerade.mkdir()
    (masquerade / "c++").symlink_to(sys.executable)
    assert compile_through_ccache(environ, str(masquerade)) and compile_through_ccache(environ, str(masquerade))
    assert environ["PATH"] == f"{masquerade}:/usr/local/bin:/usr/bin"
