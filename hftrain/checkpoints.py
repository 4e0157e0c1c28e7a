"""Checkpoints that become visible only when complete, and the choice of the one to resume from.

The Trainer writes `checkpoint-N` in place and resumes from the highest N whatever is inside, so a save cut short
would be resumed from. hftrain writes into `output_dir/_incomplete/checkpoint-N` and renames it into place once every
rank is done; `_incomplete` matches neither transformers' `checkpoint-*` patterns nor the Hub upload (it skips `_*`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import shutil

from . import manifest
from .errors import CheckpointError
from .fileio import atomic_write, fsync_tree, is_no_space, safetensors_problem

logger = logging.getLogger("hftrain")

STAGING = "_incomplete"
PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_RE = re.compile(rf"^{PREFIX}-(\d+)$")
STATE = "trainer_state.json"
# Files or folders of which at least one holds the model in a checkpoint the Trainer can load.
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
           "pytorch_model.bin", "pytorch_model_fsdp_0", "pytorch_model_fsdp.bin", "latest")


def staging_root(run_dir: str) -> str:
    return os.path.join(run_dir, STAGING)


# -- completeness -----------------------------------------------------------------------------------------------
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
    for path in _numbered(run_dir):
        problem = checkpoint_problem(path)
        if problem is None or manifest.has_manifest(path):
            return path
        warn(f"hftrain: skipping incomplete checkpoint {path}: {problem}")
    return None


def _numbered(run_dir: str) -> list[str]:
    found = sorted(((int(m.group(1)), n) for n in os.listdir(run_dir) if (m := _RE.match(n))), reverse=True)
    return [os.path.join(run_dir, name) for _, name in found]


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


# -- verification -----------------------------------------------------------------------------------------------
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
    layout_problem = _layout_problem(path)
    problems = [p for p in (checkpoint_problem(path), manifest.state_problem(path, STATE),
                            *manifest.rng_problems(path), layout_problem) if p]
    if not weights_only:
        fmt = None if layout_problem else (read_layout(path) or {}).get("strategy")
        problems += manifest.missing_optimizer_state(path, fmt in UNIVERSAL if fmt else None)
    if problems:
        raise refuse(problems)


# The first hftrain that wrote manifests (13da773); hftrain_checkpoint.json (LAYOUT) is older (1eb7516).
MANIFEST_SINCE = "2026-11-23"


def writer(path: str) -> str:
    """Who wrote a checkpoint that has no manifest, as far as its files tell: hftrain writes hftrain_checkpoint.json
    into every checkpoint (and, since MANIFEST_SINCE, the manifest last); transformers' Trainer writes
    trainer_state.json and training_args.bin but neither of hftrain's files."""
    if os.path.lexists(os.path.join(path, LAYOUT)):
        return (f"it was written by hftrain (it holds {LAYOUT}), either by a version older than the manifest (before "
                f"{MANIFEST_SINCE}) or the manifest was deleted after the save")
    if os.path.lexists(os.path.join(path, STATE)):
        return (f"it was not written by hftrain (no {LAYOUT}): by transformers' Trainer (it holds {STATE}) or "
                "another tool")
    return f"it was not written by hftrain (no {LAYOUT})"


def _others(path: str) -> str:
    run_dir, name = os.path.split(os.path.abspath(path))
    older = [p for p in _numbered(run_dir) if os.path.basename(p) != name and checkpoint_problem(p) is None]
    return f" (complete, still to be verified: {', '.join(older)})" if older else ""


# -- another world size -------------------------------------------------------------------------------------------
LAYOUT = "hftrain_checkpoint.json"  # how the checkpoint was written: world size, batch layout, strategy
# DDP's and FSDP2's checkpoints load on any number of ranks; ZeRO's per-rank optimizer partitions only through a
# DeepSpeed "universal" checkpoint (to_universal), and not at all with the optimizer on NVMe (per-rank swap files).
UNIVERSAL = ("zero1", "zero2", "zero3")
LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's name for the file naming the universal tag


def checkpoint_format(strategy: str | None) -> str:
    """Strategies that write the same checkpoint format share a name (offload changes where state lives, not how
    it is saved)."""
    return {"zero3_offload": "zero3", "zero_infinity": "zero3", None: "ddp"}.get(strategy, strategy)


def layout(world_size: int, per_device: int, accumulation: int, strategy: str | None,
           sequence_parallel: int = 1) -> dict:
    """How a run is laid out, as a checkpoint records it; `sequence_parallel` only when > 1 (ranks per sequence:
    the data-parallel size is world_size / it)."""
    out = {"world_size": world_size, "per_device_train_batch_size": per_device,
           "gradient_accumulation_steps": accumulation, "strategy": checkpoint_format(strategy),
           "nvme_optimizer": strategy == "zero_infinity"}
    if sequence_parallel > 1:
        out["sequence_parallel"] = sequence_parallel
    return out


def read_layout(path: str) -> dict | None:
    """The layout a checkpoint was written with; None without the file (written by something else: nothing to
    compare); CheckpointError naming the file when it exists but is not one."""
    f = os.path.join(path, LAYOUT)
    if not os.path.lexists(f):
        return None
    problem = _layout_problem(path)
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}")
    with open(f, encoding="utf-8") as fh:
        return json.load(fh)


def _layout_problem(path: str) -> str | None:
    f = os.path.join(path, LAYOUT)
    if not os.path.lexists(f):
        return None
    try:
        with open(f, encoding="utf-8") as fh:
            data = json.load(fh)
        want = layout(1, 1, 1, None)
        if not isinstance(data, dict) or any(type(data.get(k)) is not type(v) for k, v in want.items()):
            return f"{f}: not an hftrain layout (needs {', '.join(want)})"
    except (OSError, ValueError) as e:
        return f"{f}: not readable ({type(e).__name__}: {e})"
    return None


def needs_universal(path: str | None, now: dict) -> bool:
    """A ZeRO checkpoint resumed by another number of ranks: its optimizer partitions must be resharded."""
    was = read_layout(path) if path else None
    return (was is not None and was["strategy"] == now["strategy"] in UNIVERSAL
            and was["world_size"] != now["world_size"])


def check_layout(path: str | None, now: dict) -> None:
    problems = layout_problems(path, now) if path else []
    if problems:
        raise CheckpointError(f"cannot resume from {path} exactly: " + "; ".join(problems))


def layout_problems(path: str, now: dict) -> list[str]:
    """Can a run laid out as `now` resume from `path` exactly? The data position carries over when the global
    batch (world x micro-batch x accumulation) is the same; the state when the strategy can reshard it."""
    was = read_layout(path)
    if was is None:
        return []
    problems = []
    if was["strategy"] != now["strategy"]:
        problems.append(f"{path} was written by strategy '{was['strategy']}', this run is '{now['strategy']}': their "
                        f"checkpoint formats differ; resume with strategy.name: {was['strategy']}")
    elif was["world_size"] != now["world_size"] and (was.get("nvme_optimizer") or now.get("nvme_optimizer")):
        problems.append(
            f"{path} was written by {was['world_size']} ranks, this run has {now['world_size']}, and with the "
            "optimizer on NVMe (zero_infinity) DeepSpeed restores each rank's own swap files, which cannot be "
            f"resharded. Resume with {was['world_size']} processes, or with strategy.name: zero3_offload (or "
            "zero3), which reshards through a universal checkpoint")
    sp_was, sp_now = was.get("sequence_parallel", 1), now.get("sequence_parallel", 1)
    if sp_was != sp_now or (sp_was > 1 and was["world_size"] != now["world_size"]):
        problems.append(f"{path} was written with {was['world_size']} ranks and strategy.sequence_parallel {sp_was}, "
                        f"this run has {now['world_size']} and {sp_now}: a sequence-parallel checkpoint resumes on "
                        f"the same layout only; resume with {was['world_size']} processes and "
                        f"strategy.sequence_parallel: {sp_was}")
        return problems
    g_was = was["world_size"] * was["per_device_train_batch_size"] * was["gradient_accumulation_steps"]
    g_now = now["world_size"] * now["per_device_train_batch_size"] * now["gradient_accumulation_steps"]
    if g_was != g_now:
        problems.append(
            f"{path} was trained with {g_was} examples per step ({was['world_size']} ranks x "
            f"per_device_train_batch_size {was['per_device_train_batch_size']} x gradient_accumulation_steps "
            f"{was['gradient_accumulation_steps']}), this run takes {g_now} ({now['world_size']} x "
            f"{now['per_device_train_batch_size']} x {now['gradient_accumulation_steps']}): the data position and the "
            f"schedule would not carry over. Set training.per_device_train_batch_size or "
            f"training.gradient_accumulation_steps so that the product is {g_was}")
    return problems


def to_universal(path: str) -> str:
    """Make `path/<tag>_universal` from the ZeRO checkpoint `path/<tag>` (DeepSpeed's ds_to_universal) and name it
    in `path/latest_universal`; a later resume reuses it. Staged and renamed, so an interrupted conversion leaves
    nothing DeepSpeed would load. Run on the main process (the others wait: distributed.main_process_first)."""
    def read(name: str) -> str | None:
        try:
            with open(os.path.join(path, name), encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError:
            return None

    tag = read("latest")
    if not tag:
        raise CheckpointError(f"{path} has no DeepSpeed `latest` file naming its ZeRO state, so it cannot be "
                              "resharded; resume with the world size that wrote it")
    name = f"{tag}_universal"
    target, marker = os.path.join(path, name), os.path.join(path, LATEST_UNIVERSAL)
    if os.path.isdir(target) and read(LATEST_UNIVERSAL) == name:
        return target
    staged = os.path.join(path, f"_{name}.partial")
    shutil.rmtree(staged, ignore_errors=True)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # optional dependency: ZeRO only

    # inject_missing_state: a transformers model carries no UNIVERSAL_CHECKPOINT_INFO (Megatron-style tensor
    # parallel layouts); without it the converter refuses even a plain data-parallel checkpoint.
    args = argparse.Namespace(input_folder=os.path.join(path, tag), output_folder=staged, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            ds_to_universal(args)
    except Exception as e:
        shutil.rmtree(staged, ignore_errors=True)
        raise CheckpointError(f"converting {os.path.join(path, tag)} to a universal checkpoint failed ({e}); resume "
                              f"with the world size that wrote it. DeepSpeed's output:\n"
                              f"{log.getvalue()[-2000:]}") from e
    fsync_tree(staged)
    if os.path.isdir(target):
        shutil.rmtree(target)
    os.rename(staged, target)
    atomic_write(marker, name)
    manifest.add_to_manifest(path, [name, LATEST_UNIVERSAL])  # hftrain's own addition, recorded as verified
    return target


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
