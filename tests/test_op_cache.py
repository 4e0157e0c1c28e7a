"""DeepSpeed's op cache and the build locks a stopped build leaves in it (hftrain/launch/machine.py).

torch's JIT build takes `<op>/lock` and every other process waits for the file to go, with no time-out: a build
killed mid-way (a test's time-out did it in one CI, and its lock failed every ZeRO run of the next) would hang every
later run before training. A ZeRO run releases the locks no build holds before its ops load; the locks of a build
that may still be going are kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hftrain.config import StrategySection
from hftrain.launch import setup
from hftrain.launch.machine import STALE_LOCK_S
from hftrain.launch.strategy_checks import machine_strategy_problems
from hftrain.methods import load_recipe


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
def op_cache(tmp_path, monkeypatch):
    root = tmp_path / "extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def test_a_lock_a_stopped_build_left_is_released_and_the_run_says_so(op_cache, capsys):
    stopped = op_folder(op_cache, "cpu_adam", age_s=STALE_LOCK_S + 5 * 60)
    fresh = op_folder(op_cache, "async_io", age_s=30)  # a build that just began
    writing = op_folder(op_cache, "pin_memory", age_s=STALE_LOCK_S + 5 * 60, written_s=60)  # a long build, going on
    setup.prepare_op_cache()
    assert not os.path.exists(stopped) and os.path.exists(fresh) and os.path.exists(writing)
    out = capsys.readouterr().out
    assert f"removed DeepSpeed's op build lock {stopped}: taken 20 min ago by a build that was stopped" in out
    assert fresh not in out and writing not in out


@pytest.mark.skipif(not os.path.isdir("/proc/self/cwd"), reason="no /proc to see a process's working directory")
def test_a_lock_whose_folder_a_process_works_in_is_kept(op_cache):
    """ninja and the compiler run in the op's folder: a compile of one file may write nothing for many minutes."""
    lock = op_folder(op_cache, "cpu_adam", age_s=STALE_LOCK_S + 5 * 60)
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=os.path.dirname(lock))
    try:
        setup.prepare_op_cache()
        assert os.path.exists(lock)
    finally:
        compiler.kill()
        compiler.wait()
    setup.prepare_op_cache()  # the process gone, nothing holds the lock
    assert not os.path.exists(lock)


def test_the_preflight_leaves_a_stopped_builds_lock_to_the_run(op_cache):
    """`hftrain check` does not refuse what the run mends: the lock is neither a problem nor removed by the check."""
    lock = op_folder(op_cache, "cpu_adam", age_s=STALE_LOCK_S + 5 * 60)
    assert machine_strategy_problems(StrategySection(name="zero2")) == []
    assert os.path.exists(lock)


@pytest.mark.parametrize("name, released", [("zero2", True), ("zero3_offload", True), ("ddp", False)])
def test_a_zero_runs_set_up_releases_the_locks_before_its_ops_load(op_cache, monkeypatch, name, released):
    monkeypatch.setattr(setup, "share_fp32_master_with_fp32_weights", lambda: None)  # a process-wide patch
    lock = op_folder(op_cache, "cpu_adam", age_s=STALE_LOCK_S + 5 * 60)
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
