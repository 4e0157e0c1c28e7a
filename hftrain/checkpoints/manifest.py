"""The manifest of a checkpoint: the size and sha256 of every file in it (subfolders included: DeepSpeed's
global_stepN/, FSDP's optimizer_0/ ...), written last and atomically by the main process once every rank has written
its part, before the rename that publishes the checkpoint (StagedCheckpointMixin._save_checkpoint). At resume, a file
missing, of another size, of another sha256, or added after the save is named; a checkpoint without a manifest (plain
Trainer, older hftrain) is unverified.
Beside it, the defensive reads of what the Trainer loads unchecked at resume (trainer_state.json, rng_state*.pth)
and the presence of the optimizer and scheduler state, which the Trainer would silently re-initialise.

Files are hashed in chunks (bounded memory). Digests are remembered per process by (path, size, mtime, inode), so
the preflight check and train() of the same run hash a checkpoint once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import torch
from transformers import TrainerState
from transformers.trainer_pt_utils import safe_globals

from ..fileio import atomic_write

MANIFEST = "hftrain_manifest.json"
FORMAT = 1
CHUNK = 1 << 22  # bytes read at a time
_DIGESTS: dict[tuple, str] = {}


def sha256_file(path: str) -> str:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(CHUNK):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def _own_leftover(rel: str) -> bool:
    """hftrain's own scratch names inside a published checkpoint: an interrupted universal conversion
    (checkpoints.to_universal removes it before converting again) or a manifest rewrite cut short."""
    top = rel.split("/", 1)[0]
    return (top.startswith("_") and top.endswith(".partial")) or top.startswith(f"{MANIFEST}.tmp-")


def files_of(folder: str) -> list[str]:
    """Every file under folder as a '/'-separated relative path, the manifest itself excepted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def entry(folder: str, rel: str) -> dict:
    path = os.path.join(folder, rel)
    return {"size": os.path.getsize(path), "sha256": sha256_file(path)}


def write_manifest(folder: str) -> None:
    """Hash every file of folder and write the manifest (atomically: a reader sees all of it or none)."""
    files = {rel: entry(folder, rel) for rel in files_of(folder) if not _own_leftover(rel)}
    atomic_write(os.path.join(folder, MANIFEST), json.dumps({"format": FORMAT, "files": files}, indent=1))


def add_to_manifest(folder: str, under: list[str]) -> None:
    """Record files hftrain adds to a published checkpoint (a universal conversion), when it has a manifest."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return
    files = read_manifest(folder)
    for rel in files_of(folder):
        if rel.split("/", 1)[0] in under:
            files[rel] = entry(folder, rel)
    atomic_write(path, json.dumps({"format": FORMAT, "files": files}, indent=1))


class ManifestUnreadable(ValueError):
    pass


def read_manifest(folder: str) -> dict[str, dict]:
    """{relative path: {size, sha256}}; ManifestUnreadable naming the file when it is not a manifest."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        files = data["files"]
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                for v in files.values()):
            raise ValueError("an entry without an integer size and a sha256")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestUnreadable(f"{os.path.basename(folder)}/{MANIFEST}: not a readable manifest "
                                 f"({type(e).__name__}: {e}); it changed after the save") from None
    return files


def has_manifest(folder: str) -> bool:
    return os.path.lexists(os.path.join(folder, MANIFEST))


def manifest_problems(folder: str, ignore=lambda rel: False) -> list[str] | None:
    """None when folder has no manifest (unverified); else one line per file that is missing, of another size,
    of another sha256, or not in the manifest. Paths for which `ignore(rel)` is true are not checked."""
    if not has_manifest(folder):
        return None
    name = os.path.basename(folder)
    try:
        files = read_manifest(folder)
    except ManifestUnreadable as e:
        return [str(e)]
    present = {rel for rel in files_of(folder) if not _own_leftover(rel)}
    problems = []
    for rel in sorted(r for r in present - files.keys() if not ignore(r)):
        problems.append(f"{name}/{rel}: not in the manifest (added after the save)")
    for rel, want in sorted(files.items()):
        if ignore(rel):
            continue
        if rel not in present:
            problems.append(f"{name}/{rel}: missing (the manifest lists it: it was deleted after the save)")
        elif (size := os.path.getsize(os.path.join(folder, rel))) != want["size"]:
            problems.append(f"{name}/{rel}: {size} bytes, the manifest says {want['size']} (the file changed after "
                            "the save)")
    if problems:
        return problems  # refused already: no need to hash
    for rel, want in sorted(files.items()):
        if not ignore(rel) and sha256_file(os.path.join(folder, rel)) != want["sha256"]:
            problems.append(f"{name}/{rel}: sha256 differs from the manifest (the file changed after the save)")
    return problems


# -- the files the Trainer reads without checking them ---------------------------------------------------------
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")  # transformers' OPTIMIZER_NAME, OPTIMIZER_NAME_BIN (FSDP full)
SCHEDULER = "scheduler.pt"  # transformers' SCHEDULER_NAME


def optimizer_state(rel: str) -> bool:
    """Files that hold the optimizer or scheduler state (not the weights): what training.resume_weights_only skips.
    ZeRO's are not among them: its optim_states files hold the weights' partitions too."""
    top = rel.split("/", 1)[0]
    return top in (*OPTIMIZER_FILES, SCHEDULER) or (top.startswith("optimizer_") and "/" in rel)


def state_problem(path: str, state_file: str) -> str | None:
    f = os.path.join(path, state_file)
    try:
        with open(f, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict) or type(data.get("global_step")) is not int:
            return f"{f}: has no integer global_step (not a trainer state)"
        TrainerState(**data)  # what Trainer.train does with it (TrainerState.load_from_json)
    except (OSError, ValueError, TypeError) as e:
        return f"{f}: not a readable trainer state ({type(e).__name__}: {e})"
    return None


def rng_problems(path: str) -> list[str]:
    out = []
    for name in sorted(n for n in os.listdir(path) if re.fullmatch(r"rng_state(_\d+)?\.pth", n)):
        f = os.path.join(path, name)
        try:
            with safe_globals():  # the allow-list Trainer._load_rng_state loads with (numpy's state)
                state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch's message would suggest weights_only=False: never load such a file so
            out.append(f"{f}: not an RNG state torch can load safely ({type(e).__name__}); the file is damaged")
            continue
        if not isinstance(state, dict) or not {"python", "numpy", "cpu"} <= state.keys():
            out.append(f"{f}: not an RNG state written by the Trainer (no python, numpy and cpu states)")
    return out


def missing_optimizer_state(path: str, zero: bool | None) -> list[str]:
    """What is missing of the optimizer and scheduler state. `zero`: written by DeepSpeed (None: unknown, then
    guessed from DeepSpeed's `latest` file)."""
    names = set(os.listdir(path))
    zero = "latest" in names if zero is None else zero
    fix = ("; set training.resume_weights_only: true to load the weights with a fresh optimizer and learning-rate "
           "schedule")
    if zero:  # DeepSpeed keeps optimizer and schedule in global_stepN/
        tag = ""
        if "latest" in names:
            with open(os.path.join(path, "latest"), encoding="utf-8", errors="replace") as fh:
                tag = fh.read().strip()
        tag = tag or "global_stepN"
        d = os.path.join(path, tag)
        if not (os.path.isdir(d) and any(n.endswith("optim_states.pt") for n in os.listdir(d))):
            return [f"{d}/*optim_states.pt: missing (DeepSpeed's optimizer state)"]
        return []
    out = []
    if not names & set(OPTIMIZER_FILES) and not any(
            n.startswith("optimizer") and os.path.isdir(os.path.join(path, n)) for n in names):
        out.append(f"{os.path.join(path, 'optimizer.pt')}: missing (the optimizer state){fix}")
    if SCHEDULER not in names:
        out.append(f"{os.path.join(path, SCHEDULER)}: missing (the learning-rate scheduler state){fix}")
    return out
