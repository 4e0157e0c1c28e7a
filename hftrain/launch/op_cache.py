"""The build locks in DeepSpeed's op cache (launch.machine.extensions_dir) that no build holds, released.

torch's JIT build takes `<op>/lock` and every other process waits for the file to go, with no time-out and no word
(torch.utils.file_baton.FileBaton). A build stopped mid-way without its `finally` (SIGKILL: a killed launcher's
workers get it from the kernel, a time-out, scancel's second signal, the OOM killer) leaves the lock, and every later
run that needs the op would hang before training. Neither torch nor DeepSpeed clears such a lock, so hftrain does.

A lock is a live build's while a process of this machine works in the op's folder (ninja and the compiler run
there; torch starts ninja within a second or two of taking the lock). Where the cache is on a local file system that
is the whole story, after LOCAL_STALE_LOCK_S. On a network file system another machine may be building, unseen:
there a lock is released only when it and the folder's last write are both older than STALE_LOCK_S (a build writes
an object file every minute or two).

A run settles the cache before its process group starts (settle_build_locks): it removes the locks no build holds
and waits for a build going on, saying both. (A launcher killed mid-build: its workers die, but ninja and the
compiler go on to the end of their step in the op's folder; the next run waits for them, then removes the lock.)"""

from __future__ import annotations

import contextlib
import glob
import os
import time
from typing import Callable

LOCAL_STALE_LOCK_S = 60
STALE_LOCK_S = 15 * 60
# File systems other machines may write: what /proc/mounts calls them (and every FUSE one: sshfs, gcsfuse, ...).
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
                                 "glusterfs", "9p", "afs", "panfs", "wekafs", "ocfs2", "gfs2", "virtiofs"})


def build_locks(root: str, now: float | None = None) -> list[tuple[str, float]]:
    """(path, age in seconds) of torch's JIT build locks (`<op>/lock`) under DeepSpeed's op cache `root`."""
    now = time.time() if now is None else now
    found = []
    for lock in sorted(glob.glob(os.path.join(root, "*", "lock"))):
        try:
            found.append((lock, now - os.path.getmtime(lock)))
        except OSError:  # released meanwhile
            continue
    return found


def only_this_machine_builds_in(root: str) -> bool:
    """Whether the cache is on a local file system and /proc shows this machine's processes (the local rule)."""
    return on_local_filesystem(root) and os.path.exists("/proc/self/cwd")


def abandoned_build_locks(root: str, now: float | None = None, local: bool | None = None
                          ) -> list[tuple[str, float]]:
    """(path, age in seconds) of the locks under `root` that no build holds (the module's rules); `local` says
    whether only this machine can build there (by default: only_this_machine_builds_in)."""
    now = time.time() if now is None else now
    local = only_this_machine_builds_in(root) if local is None else local
    found = []
    for lock, age in build_locks(root, now):
        folder = os.path.dirname(lock)
        if processes_working_in(folder):
            continue
        if (local and age > LOCAL_STALE_LOCK_S) or (age > STALE_LOCK_S and now - _last_write(folder) > STALE_LOCK_S):
            found.append((lock, age))
    return found


def on_local_filesystem(path: str, mounts: str = "/proc/mounts") -> bool:
    """Whether `path` lies on a file system only this machine writes: its mount (the longest mount point above it) is
    of a type not in NETWORK_FILESYSTEMS and not FUSE. False where the mounts cannot be read."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mounts, encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return False
    return kind is not None and kind not in NETWORK_FILESYSTEMS and not kind.startswith("fuse")


def _last_write(folder: str) -> float:
    """When a file of `folder` was last written (0 for an empty folder)."""
    times = [0.0]
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                times.append(entry.stat(follow_symlinks=False).st_mtime)
    return max(times)


def processes_working_in(folder: str) -> list[int]:
    """The ids of this machine's processes whose working directory is `folder` (empty where /proc cannot say)."""
    folder = os.path.realpath(folder)
    found = []
    for entry in glob.glob("/proc/[0-9]*/cwd"):
        with contextlib.suppress(OSError):
            if os.readlink(entry) == folder:
                found.append(int(entry.split("/")[2]))
    return found


def release_abandoned_build_locks(root: str, local: bool | None = None) -> list[tuple[str, float]]:
    """Remove the locks no build holds; (path, age) of each removed. The ranks of a run, and runs sharing the cache,
    release one at a time (a file lock of hftrain's beside torch's): each judges the locks again once it holds it, so
    none removes a lock a build took meanwhile."""
    if not os.path.isdir(root) or not build_locks(root):
        return []
    from filelock import FileLock  # transformers' and huggingface_hub's dependency

    removed = []
    with FileLock(os.path.join(root, ".hftrain-release-locks.lock")):
        for lock, age in abandoned_build_locks(root, local=local):
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
                removed.append((lock, age))
    return removed


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def settle_build_locks(root: str, say: Callable[[str], None], poll_s: float = 1.0, tell_after_s: float = 10.0
                       ) -> None:
    """Before a process loads an op: each lock no build holds is removed, and a build going on (another run's) is
    waited for, both said, so that torch's own wait, which never ends by itself, only ever follows a build that is
    alive. Removing a lock torch already waits on would not do: its waiter then imports an op that was never built.
    A cache that cannot be locked (unwritable) is left to torch's load, which names it."""
    told, t0 = set(), time.monotonic()
    local = only_this_machine_builds_in(root)  # the mounts read once, not at every poll
    while True:
        try:
            for lock, age in release_abandoned_build_locks(root, local=local):
                say(f"removed DeepSpeed's op build lock {lock}: taken {_duration(age)} ago by a build that was "
                    "stopped (no process builds in its folder); the op is built again where it needs to be")
        except OSError:
            return
        live = build_locks(root)
        if not live:
            return
        for lock, age in live:
            if lock not in told and time.monotonic() - t0 >= tell_after_s:
                told.add(lock)
                say(f"waiting for the DeepSpeed op build going on in {os.path.dirname(lock)} (its lock taken "
                    f"{_duration(age)} ago); a lock no build holds is removed once judged so (hftrain.launch.op_cache)")
        time.sleep(poll_s)
