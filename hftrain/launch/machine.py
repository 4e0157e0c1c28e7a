"""What this machine can do for a strategy, asked before anything loads: an NVMe folder's room and permissions,
DeepSpeed's async_io op (libaio), vLLM and a GPU for GRPO's generation, DeepSpeed's JIT op cache. launch.preflight
reports them with the recipe's other problems. The build locks a stopped build leaves in the op cache are no problem
of the recipe's: the run releases them before its ops load (launch.setup)."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import sys
import tempfile
import time



def unwritable(folder: str) -> str | None:
    """Why a file cannot be created in `folder` (the OS's words), or None; the probe file is removed at once."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hftrain-write-test-"):
            pass
    except OSError as e:
        return e.strerror
    return None


def nvme_problems(path: str, need_bytes: int | None = None) -> list[str]:
    """The swap folder exists, is a folder, is writable, and has room for what will be swapped."""
    if not os.path.exists(path):
        return [f"strategy.nvme_path: {path} does not exist; create it on a local NVMe disk (mkdir -p {path}) "
                "or set strategy.nvme_path to one"]
    if not os.path.isdir(path):
        return [f"strategy.nvme_path: {path} is not a folder"]
    why = unwritable(path)
    if why:
        return [f"strategy.nvme_path: {path} is not writable ({why}); fix its permissions or choose another folder"]
    if need_bytes:
        free = shutil.disk_usage(path).free
        if free < need_bytes:
            return [f"strategy.nvme_path: {path} has {_size(free)} free but the swap needs about "
                    f"{_size(need_bytes)}; free space or choose a larger disk"]
    return []


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def async_io_problem() -> str | None:
    """DeepSpeed's async_io op (ZeRO-Infinity's NVMe I/O) needs libaio."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # optional dependency: zero_infinity only
    except ImportError:
        return "strategy.name: zero_infinity needs deepspeed (pip install deepspeed)"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("strategy.name: zero_infinity needs DeepSpeed's async_io op, which needs libaio: "
                "`apt-get install libaio-dev` (Debian/Ubuntu) or `conda install -c conda-forge libaio`")
    return None


def extensions_dir() -> str:
    """Where DeepSpeed's JIT-compiled ops live: $TORCH_EXTENSIONS_DIR, else the cache hftrain names (launch.setup
    exports it, so the build and every later run agree) rather than wherever torch's default cache happens to be.

    One folder per Python environment: an op's build commands hold the paths of the environment's torch and DeepSpeed
    headers, so an op built by one environment is rebuilt (minutes) when another loads it, and two environments
    sharing one folder (a checkout and a CI clone on the same machine) would take turns rebuilding every op."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    environment = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return os.path.expanduser(f"~/.cache/hftrain/torch_extensions/{environment}")


# A DeepSpeed op builds in minutes, and its build writes an object file every minute or two; a lock this old, in a
# folder where nothing has been written for as long, was left by a build that was stopped.
STALE_LOCK_S = 15 * 60


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


def abandoned_build_locks(root: str, now: float | None = None) -> list[tuple[str, float]]:
    """torch's JIT build takes `<op>/lock` and every other process waits for the file to go, with no time-out
    (torch.utils.file_baton.FileBaton): a build stopped mid-way (a time-out, a scancel, a killed CI job) leaves it,
    and every later run that needs the op would hang silently before training. (path, age in seconds) of the locks
    no build holds: older than STALE_LOCK_S, nothing written in the op's folder for as long, and no process of this
    machine working in it (ninja and the compiler run there; a build on another machine sharing the cache shows
    in the folder's writes)."""
    now = time.time() if now is None else now
    return [(lock, age) for lock, age in build_locks(root, now)
            if age > STALE_LOCK_S and now - _last_write(os.path.dirname(lock)) > STALE_LOCK_S
            and not processes_working_in(os.path.dirname(lock))]


def _last_write(folder: str) -> float:
    """When a file of `folder` was last written (0 for an empty folder)."""
    times = [0.0]
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


def release_abandoned_build_locks(root: str) -> list[tuple[str, float]]:
    """Remove the build locks no build holds (abandoned_build_locks) before anything waits on them; (path, age) of
    each removed. The ranks of a run, and runs sharing the cache, release one at a time (a file lock of hftrain's,
    beside torch's): each judges the locks again once it holds it, so none removes a lock a build took meanwhile."""
    if not os.path.isdir(root) or not build_locks(root):
        return []
    from filelock import FileLock  # transformers' and huggingface_hub's dependency

    removed = []
    with FileLock(os.path.join(root, ".hftrain-release-locks.lock")):
        for lock, age in abandoned_build_locks(root):
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
                removed.append((lock, age))
    return removed
