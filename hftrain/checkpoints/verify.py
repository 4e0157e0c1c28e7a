"""Which checkpoint to resume from, and whether it is whole: its files against its manifest (sizes and sha256), the
state files readable, the optimizer and scheduler there (unless the weights alone are resumed)."""

from __future__ import annotations

import logging
import os

from ..errors import CheckpointError
from . import manifest
from .folders import STATE, numbered_checkpoints, checkpoint_problem, newest_complete
from .world_size import LAYOUT, UNIVERSAL, layout_problem, read_layout

logger = logging.getLogger("hftrain")


def resolve_resume(value, output_dir: str, restarted: bool = False, warn=logger.warning,
                   weights_only: bool = False) -> str | None:
    """What to resume from: `training.resume_from_checkpoint` (true = the newest complete checkpoint, a path =
    that checkpoint, checked), or after an elastic restart (`restarted`) the newest complete one if any. The
    checkpoint is then verified (`verify`)."""
    if value is True or (restarted and value in (None, False)):
        skipped: list[str] = []
        path = newest_complete(output_dir, lambda m: (skipped.append(m), warn(m)))
        if path is None and value is True:
            seen = "".join(f" ({m.removeprefix('hftrain: ')})" for m in skipped if "skipping" in m)
            raise CheckpointError(
                f"training.resume_from_checkpoint is true but {output_dir} holds no complete checkpoint-N folder"
                f"{seen}; set it to false to start from scratch, or to the path of a checkpoint")
        if path is not None:
            verify(path, weights_only, warn)
        return path
    if value in (None, False, ""):
        return None
    if not manifest.has_manifest(value):  # with a manifest, verify names the damaged files themselves
        problem = checkpoint_problem(value)
        if problem:
            raise CheckpointError(f"training.resume_from_checkpoint: cannot resume from {value}: {problem}. "
                                  "Point it at a complete checkpoint, or set it to true for the newest complete one")
    verify(value, weights_only, warn)
    return value


# (checkpoint, weights_only) -> (its files' stat, what its verification warned) when it passed
_verified: dict[tuple[str, bool], tuple] = {}


def _stat_signature(path: str) -> tuple:
    """(relative path, size, mtime) of every file under `path`: what a change since a verification would alter."""
    out = []
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            out.append((os.path.relpath(os.path.join(root, name), path), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


def verify(path: str, weights_only: bool = False, warn=logger.warning) -> None:
    """Refuse (CheckpointError naming each file) a checkpoint whose files differ from its manifest, whose
    trainer_state.json, rng_state*.pth or hftrain_checkpoint.json cannot be read, or (unless weights_only) whose
    optimizer or scheduler state is missing. A checkpoint that passed in this process and whose files' sizes and
    times are unchanged is not read again (the run checks it before the model loads and the trainer at resume: one
    sha256 pass over a checkpoint of many GB is enough)."""
    key = (os.path.realpath(path), weights_only)
    signature = _stat_signature(path) if os.path.isdir(path) else None
    if signature is not None and key in _verified and _verified[key][0] == signature:
        for message in _verified[key][1]:  # what the first verification said is said again (the run's log)
            warn(message)
        return
    said: list[str] = []
    _verify(path, weights_only, lambda m: (said.append(m), warn(m)))
    if signature is not None:
        _verified[key] = (signature, said)


def _verify(path: str, weights_only: bool, warn) -> None:
    def refuse(problems: list[str], extra: str = "") -> CheckpointError:
        return CheckpointError(f"cannot resume from {path}: " + "; ".join(problems) + ". Resume from another "
                               f"checkpoint: set training.resume_from_checkpoint to its path{_others(path)}, or to "
                               f"false to start from scratch{extra}")

    problems = manifest.manifest_problems(path, ignore=manifest.optimizer_state if weights_only else lambda r: False)
    if problems:
        only_opt = all(manifest.optimizer_state(p.split(": ", 1)[0].split("/", 1)[1]) for p in problems if "/" in p)
        raise refuse(problems, " (or, to load the weights with a fresh optimizer and schedule, set "
                               "training.resume_weights_only: true)" if only_opt else "")
    if problems is None:
        warn(f"hftrain: {path} has no {manifest.MANIFEST}: {writer(path)}; its files cannot be verified (only "
             "checked complete and readable)")
    layout = layout_problem(path)
    problems = [p for p in (checkpoint_problem(path), manifest.state_problem(path, STATE),
                            *manifest.rng_problems(path), layout) if p]
    if not weights_only:
        fmt = None if layout else (read_layout(path) or {}).get("strategy")
        problems += manifest.missing_optimizer_state(path, fmt in UNIVERSAL if fmt else None)
    if problems:
        raise refuse(problems)


def writer(path: str) -> str:
    """Who wrote a checkpoint that has no manifest, as far as its files tell: hftrain writes hftrain_checkpoint.json
    and, last, the manifest into every checkpoint; transformers' Trainer writes trainer_state.json and
    training_args.bin but neither of hftrain's files."""
    if os.path.lexists(os.path.join(path, LAYOUT)):
        return f"it was written by hftrain (it holds {LAYOUT}) and its manifest was deleted after the save"
    if os.path.lexists(os.path.join(path, STATE)):
        return (f"it was not written by hftrain (no {LAYOUT}): by transformers' Trainer (it holds {STATE}) or "
                "another tool")
    return f"it was not written by hftrain (no {LAYOUT})"


def _others(path: str) -> str:
    run_dir, name = os.path.split(os.path.abspath(path))
    older = [p for p in numbered_checkpoints(run_dir) if os.path.basename(p) != name and checkpoint_problem(p) is None]
    return f" (complete, still to be verified: {', '.join(older)})" if older else ""
