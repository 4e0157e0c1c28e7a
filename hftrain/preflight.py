"""Checks before any model is loaded: what would otherwise fail minutes (or hours) into a run.

Every problem found is reported at once, with the key to change and the fix.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time

from .recipe import StrategySection, accelerator_available
from .strategies import ZERO_STAGE

# Bytes per parameter that ZeRO-Infinity swaps to NVMe, summed over the ranks of a node: the parameters
# (conservatively fp32) plus the optimizer's fp32 gradients, master weights and two moments (hftrain.plan).
NVME_BYTES_PER_PARAM = 4 + 16


def facts_or_none(name_or_path: str, trust_remote_code: bool = False):
    """hftrain.plan.model_facts, or None when the config cannot be read here (e.g. an unreachable Hub id:
    loading the model will then say so)."""
    from .plan import model_facts

    try:
        return model_facts(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:
        return None


def nvme_problems(path: str, need_bytes: int | None = None) -> list[str]:
    """The swap folder exists, is a folder, is writable, and has room for what will be swapped."""
    if not os.path.exists(path):
        return [f"strategy.nvme_path: {path} does not exist; create it on a local NVMe disk (mkdir -p {path}) "
                "or set strategy.nvme_path to one"]
    if not os.path.isdir(path):
        return [f"strategy.nvme_path: {path} is not a folder"]
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hftrain-write-test-"):
            pass
    except OSError as e:
        return [f"strategy.nvme_path: {path} is not writable ({e.strerror}); fix its permissions or choose another folder"]
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
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return "strategy.name: zero_infinity needs deepspeed (pip install deepspeed)"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("strategy.name: zero_infinity needs DeepSpeed's async_io op, which needs libaio: "
                "`apt-get install libaio-dev` (Debian/Ubuntu) or `conda install -c conda-forge libaio`")
    return None


def extensions_dir() -> str:
    """Where DeepSpeed's JIT-compiled ops live: $TORCH_EXTENSIONS_DIR, which hftrain sets (if unset) to a cache it
    names rather than wherever the home directory's torch cache happens to be."""
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/hftrain/torch_extensions"))


# A DeepSpeed op builds in minutes (async_io, the slowest here, in ~4 on 2 cores); a build lock older than this was
# left by a build that was killed.
STALE_LOCK_S = 15 * 60


def stale_build_locks(root: str, now: float | None = None) -> list[tuple[str, float]]:
    """torch's JIT build takes `<op>/lock` and every other process waits for the file to go, with no time-out
    (torch.utils.file_baton.FileBaton): a build killed mid-way (a time-out, a scancel) leaves it, and every later
    run that needs the op then hangs silently before training. (path, age in seconds) of old lock files."""
    now = time.time() if now is None else now
    found = []
    for lock in sorted(glob.glob(os.path.join(root, "*", "lock"))):
        try:
            age = now - os.path.getmtime(lock)
        except OSError:  # released meanwhile
            continue
        if age > STALE_LOCK_S:
            found.append((lock, age))
    return found


def strategy_problems(strategy: StrategySection, num_parameters: int | None = None) -> list[str]:
    problems = []
    if strategy.name in ZERO_STAGE:
        problems += [f"DeepSpeed op build lock {lock} is {age / 60:.0f} min old: a build was interrupted and every "
                     f"run needing that op would wait for it forever; remove it (rm {lock})"
                     for lock, age in stale_build_locks(extensions_dir())]
    if strategy.name == "zero_infinity":
        from .strategies import resolved

        s = resolved(strategy)
        need = num_parameters * NVME_BYTES_PER_PARAM if num_parameters else None
        problems += nvme_problems(s.nvme_path, need)
        p = async_io_problem()
        if p:
            problems.append(p)
    if strategy.name == "fsdp" and strategy.fsdp_offload_params and not accelerator_available():
        problems.append("strategy.fsdp_offload_params: there is no accelerator to offload from on this machine; "
                        "remove it (parameters already live in CPU memory)")
    return problems


def output_dir_problems(path: str) -> list[str]:
    """output_dir, or the folder it will be created in, is a writable folder. Nothing is created here: a refused
    run leaves nothing behind."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"training.output_dir: {path} cannot be created: {parent} is not a folder; choose another path"]
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".hftrain-write-test-"):
            pass
    except OSError as e:
        return [f"training.output_dir: cannot write in {parent} ({e.strerror}); fix its permissions or choose "
                "another folder"]
    return []


def resume_problems(value, output_dir: str, layout: dict | None = None) -> list[str]:
    """training.resume_from_checkpoint names (or, when true, finds) a complete checkpoint that this run's layout
    (checkpoints.layout) can resume exactly: checked before any model is loaded, not minutes later in train()."""
    from .checkpoints import CheckpointError, check_layout, resolve_resume

    try:
        path = resolve_resume(value, output_dir, warn=lambda _m: None)
        if layout is not None:
            check_layout(path, layout)
    except CheckpointError as e:
        return [str(e)]
    return []
