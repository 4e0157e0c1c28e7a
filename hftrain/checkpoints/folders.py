"""A run's checkpoint folders: their names, the staging root a save is written into (renamed into place once every
rank is done), which are complete, the newest complete one, and the error of a save that failed."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

from safetensors import safe_open

from ..errors import CheckpointError
from ..fileio import is_no_space, safetensors_problem
from . import manifest

logger = logging.getLogger("hftrain")

STAGING = "_incomplete"
PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_RE = re.compile(rf"^{PREFIX}-(\d+)$")
STATE = "trainer_state.json"
# Files or folders of which at least one holds the model in a checkpoint the Trainer can load.
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
           "pytorch_model.bin", "pytorch_model_fsdp_0", "pytorch_model_fsdp.bin", "latest")


def saved_weight_names(path: str) -> set[str]:
    """The tensor names of a checkpoint's whole-model safetensors (model.safetensors, or its index), from the headers
    alone; empty when it holds none (an adapter, FSDP's or DeepSpeed's own format)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            return set(json.load(fh)["weight_map"])
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        return set()
    with safe_open(single, framework="pt") as fh:
        return set(fh.keys())


def staging_root(run_dir: str) -> str:
    return os.path.join(run_dir, STAGING)


def checkpoint_problem(path: str) -> str | None:
    """Why `path` is not a complete checkpoint, or None. Checks what a save writes last (trainer_state.json),
    that some weights are there, and that every safetensors file (and index shard) is whole."""
    if not os.path.isdir(path):
        return f"{path} is not a folder"
    names = set(os.listdir(path))
    if STATE not in names:
        return f"{path} has no {STATE} (the save did not finish)"
    if not names & set(WEIGHTS):
        return f"{path} holds no weights (none of {', '.join(WEIGHTS[:3])}, ...)"
    index = os.path.join(path, "model.safetensors.index.json")
    files = {n for n in names if n.endswith(".safetensors")}
    if os.path.isfile(index):
        try:
            shards = set(json.load(open(index))["weight_map"].values())
        except (OSError, ValueError, KeyError) as e:
            return f"{index}: unreadable ({e})"
        missing = shards - names
        if missing:
            return f"{path} misses the shards {sorted(missing)}"
        files |= shards
    for name in sorted(files):
        p = safetensors_problem(os.path.join(path, name))
        if p:
            return p
    return None


def newest_complete(run_dir: str, warn=logger.warning) -> str | None:
    """The complete `checkpoint-N` with the highest N in run_dir; incomplete ones are skipped with a warning. One
    with a manifest was published complete by hftrain: it is returned whatever it holds now, for `verify` to judge
    (a damaged checkpoint is refused, never skipped in silence for an older one)."""
    if not os.path.isdir(run_dir):
        return None
    if os.path.isdir(staging_root(run_dir)) and os.listdir(staging_root(run_dir)):
        warn(f"hftrain: ignoring {staging_root(run_dir)}: a save that was interrupted (never resumed from)")
    for path in numbered_checkpoints(run_dir):
        problem = checkpoint_problem(path)
        if problem is None or manifest.has_manifest(path):
            return path
        warn(f"hftrain: skipping incomplete checkpoint {path}: {problem}")
    return None


def numbered_checkpoints(run_dir: str) -> list[str]:
    found = sorted(((int(m.group(1)), n) for n in os.listdir(run_dir) if (m := _RE.match(n))), reverse=True)
    return [os.path.join(run_dir, name) for _, name in found]


def save_failure(exc: BaseException, staged: str, run_dir: str) -> CheckpointError:
    """The error to raise when a save failed (call it before removing the partial save: it measures the free
    space): what, where, and what is still there to resume from."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = None
    last = newest_complete(run_dir, warn=lambda _m: None)
    keep = f"the last complete checkpoint, {last}, is intact" if last else "no complete checkpoint exists yet"
    if is_no_space(exc, free):
        left = f"{free / 2**10:.0f} KiB free" if free is not None else "free space unknown"
        why = f"no space left on the device of {run_dir} ({left}; {type(exc).__name__}: {exc})"
        fix = "Free space or point training.output_dir at a larger disk (or lower training.save_total_limit)"
    else:
        why = f"{type(exc).__name__}: {exc}"
        fix = "Fix the cause"
    return CheckpointError(f"saving {os.path.basename(staged)} into {staged} failed: {why}; the partial save was "
                           f"removed and {keep}. {fix}, then resume with training.resume_from_checkpoint=true")
