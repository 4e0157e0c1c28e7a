"""What this machine can do for a strategy, asked before anything loads: an NVMe folder's room and permissions,
DeepSpeed's async_io op (libaio), vLLM and a GPU for GRPO's generation, DeepSpeed's JIT op cache. launch.preflight
reports them with the recipe's other problems. The build locks a stopped build leaves in the op cache are no problem
of the recipe's: the run releases them (launch.op_cache)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile



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
