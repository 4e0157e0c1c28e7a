"""Whose output_dir is it: a run refuses a folder holding another run, or files hftrain did not write, unless the
recipe says to continue (training.resume_from_checkpoint) or to start over (training.overwrite_output_dir); and the
run holds an exclusive lock on the folder for its lifetime, so that a second run into it is refused naming the first.

Why by hand: transformers 5 dropped TrainingArguments.overwrite_output_dir and never locked output_dir; a second run
into the same folder rotates away the first one's checkpoints and a later resume mixes the two.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import sys
import time

from .checkpoints import LAYOUT, PREFIX, STAGING
from .constants import RECIPE_FILE, RUN_INFO_FILE, SLURM_DIR, STRATEGIES
from .errors import LaunchError

LOCK_FILE = ".hftrain.lock"
# Written only by `hftrain config` / `hftrain launch` before a run starts: a folder holding these alone is not a run
# (SLURM_DIR: the job's log folder, made by `hftrain config --slurm`).
CONFIG_FILES = {f"{name}.{ext}" for name in STRATEGIES for ext in ("yaml", "json")} | {"launch.sbatch", SLURM_DIR}
OVERWRITE = "overwrite_output_dir"

_held: dict[str, int] = {}  # realpath -> file descriptor of the lock this process holds (released at exit)


def holder(path: str) -> str | None:
    """Who holds output_dir's lock now ("pid P on host H since T: command"), or None. Writes nothing: the lock file
    is opened read-only and a shared lock is tried, which fails while a run holds the exclusive one."""
    if os.path.realpath(path) in _held:
        return None  # this process's own run
    lock = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            with os.fdopen(os.dup(fd), encoding="utf-8", errors="replace") as fh:
                return fh.read(500).strip() or "another process"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def run_state(path: str) -> tuple[str, list[str]]:
    """What output_dir holds: ('new', []) absent, empty, only hftrain's launcher configs, or a run stopped before its
    first checkpoint; ('finished', names) a run that saved its final model (run_info.json); ('unfinished', names) a
    run's checkpoints without the final save; ('foreign', names) files hftrain did not write."""
    try:
        names = sorted(n for n in os.listdir(path) if n != LOCK_FILE)
    except FileNotFoundError:
        return "new", []
    except NotADirectoryError:
        return "foreign", [path]
    if RUN_INFO_FILE in names:
        return "finished", [RUN_INFO_FILE]
    saved = [n for n in names if n.startswith(f"{PREFIX}-")]
    if saved:
        return "unfinished", saved
    # A run that stopped before its first checkpoint left nothing to lose: its recipe copy and staging are rewritten.
    other = [n for n in names if n not in CONFIG_FILES and n not in (RECIPE_FILE, STAGING)]
    return ("foreign", other) if other else ("new", [])


def ownership_problem(path: str, resume: bool, overwrite: bool, locked: bool = False) -> str | None:
    """Why this run may not use output_dir, or None. Checked before anything is written (preflight), and again by
    `claim` under the lock (`locked`: this process holds it, so no other run can)."""
    who = None if locked else holder(path)
    if who:
        return (f"training.output_dir: {path} is in use by another run ({who}); wait for it to end, or give this run "
                "another folder")
    state, names = run_state(path)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if state == "finished" and not (resume or overwrite):
        return (f"training.output_dir: {path} holds a finished run ({shown}); training into it would rotate away its "
                f"checkpoints and mix two runs. Give this run another folder, or set training.{OVERWRITE}: true to "
                "replace it")
    if state == "unfinished" and not (resume or overwrite):
        return (f"training.output_dir: {path} holds a run that did not finish ({shown}). Continue it with "
                f"training.resume_from_checkpoint: true, start over with training.{OVERWRITE}: true (its checkpoints "
                "are removed), or give this run another folder")
    if state == "foreign" and not overwrite:
        return (f"training.output_dir: {path} holds files hftrain did not write ({shown}); a run saves and rotates "
                f"files there. Give the run a folder of its own, or set training.{OVERWRITE}: true to train into it "
                "anyway")
    return None


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def guarded_folder_problem(path: str, protected: dict[str, str] | None = None) -> str | None:
    """output_dir must not be `/`, the home folder or the working folder (a run writes and rotates files there), nor
    be, contain or lie inside a folder the run reads from (`protected`: description -> path), which its save would
    overwrite."""
    real = os.path.realpath(path)
    for what, folder in (("the filesystem root", "/"), ("your home folder", os.path.expanduser("~")),
                         ("the folder you run from", os.getcwd())):
        if real == os.path.realpath(folder):
            return f"training.output_dir: {path} is {what}; give the run a folder of its own (e.g. runs/my-run)"
    for what, folder in (protected or {}).items():
        other = os.path.realpath(folder)
        if _within(real, other) or _within(other, real):
            return (f"training.output_dir: {path} {'is' if real == other else 'overlaps'} {what} ({folder}): the "
                    "final save would overwrite it; choose another folder")
    return None


def claim(path: str, overwrite: bool, resumed: bool, say=print, protected: dict[str, str] | None = None) -> None:
    """Take output_dir's exclusive lock for this process's lifetime (main process only; the kernel releases it when
    the process ends, however it ends), then, under the lock and before anything else is written, check the folder
    again: what it is (guarded_folder_problem) and what it holds now (ownership_problem). A run whose checks passed
    minutes ago (a slow data phase) may find that another run has since finished there: it is refused like a run
    started after it. Only then, when starting over (`overwrite` and not resuming), remove the previous run's
    checkpoints and run_info.json so that neither rotation nor a later resume can mix the two runs.

    A refusal leaves the folder as it was: the lock file (and the folder) are removed again when this call made
    them."""
    real = os.path.realpath(path)
    if real in _held:
        return
    guarded = guarded_folder_problem(path, protected)
    if guarded:
        raise LaunchError(guarded)
    made_dir = not os.path.lexists(path)
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, LOCK_FILE)
    try:
        fd, made_lock = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        fd, made_lock = os.open(lock, os.O_RDWR), False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)  # the holder made the lock file (and the folder): nothing of ours to remove
        raise LaunchError(f"training.output_dir: {path} is in use by another run ({holder(path) or 'unknown'}); "
                          "wait for it to end, or give this run another folder") from None
    problem = ownership_problem(path, resumed, overwrite, locked=True)
    if problem:
        _give_up(fd, lock if made_lock else None, path if made_dir else None)
        raise LaunchError(problem)
    os.ftruncate(fd, 0)
    os.write(fd, (f"pid {os.getpid()} on {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)[:300]}\n").encode())
    os.fsync(fd)  # other machines read this line to prove they see the same folder (launch.setup)
    _held[real] = fd
    if overwrite and not resumed:
        state, _ = run_state(path)
        if state in ("finished", "unfinished"):
            old = previous_run_files(path)
            for name in old:
                target = os.path.join(path, name)
                shutil.rmtree(target) if os.path.isdir(target) and not os.path.islink(target) else os.remove(target)
            if old:
                say(f"hftrain: training.{OVERWRITE}: removed the previous run's {', '.join(old)} from {path}")


def _give_up(fd: int, lock: str | None, folder: str | None) -> None:
    """Undo what a refused claim made: the lock file it created, then the folder it created (only when empty)."""
    if lock is not None:
        os.remove(lock)  # created by this call (O_EXCL), before any other run could open it: we hold the lock
    os.close(fd)
    if folder is not None:
        try:
            os.rmdir(folder)  # created by this call; rmdir removes only an empty folder
        except OSError:
            pass


def previous_run_files(path: str) -> list[str]:
    """What training.overwrite_output_dir removes: the previous run's numbered checkpoints, its staging folder,
    run_info.json and checkpoint layout file. Names only hftrain writes (checkpoint-<digits>, not checkpoint-notes)."""
    return [n for n in sorted(os.listdir(path))
            if re.fullmatch(rf"{PREFIX}-\d+", n) or n in (STAGING, RUN_INFO_FILE, LAYOUT)]


def lock_line(path: str) -> str | None:
    """The lock file's line as this machine sees it (None: no lock file here). Reads only."""
    try:
        with open(os.path.join(path, LOCK_FILE), encoding="utf-8", errors="replace") as fh:
            return fh.read(500).strip()
    except OSError:
        return None


def release(path: str) -> None:
    """Give the lock back before the process ends (tests running several runs in one process)."""
    fd = _held.pop(os.path.realpath(path), None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Give back every output_dir this process holds (several runs in one process: the next may resume one)."""
    for path in list(_held):
        release(path)
