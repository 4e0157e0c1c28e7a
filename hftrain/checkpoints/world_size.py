"""Another world size: how a checkpoint was written (world size, batch layout, strategy), what a resume on other
ranks can carry over, and the conversion of a ZeRO checkpoint to DeepSpeed's universal format."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil

from ..errors import CheckpointError
from ..fileio import atomic_write, fsync_tree
from ..mesh import RECIPE_KEYS
from . import manifest

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
           sequence_parallel: int = 1, expert_parallel: int = 1, mesh: list[int] | None = None) -> dict:
    """How a run is laid out, as a checkpoint records it; `sequence_parallel` only when > 1 (ranks per sequence:
    the data-parallel size is world_size / it); `mesh` only for an FSDP2 mesh past sharding (replicate, shard, tensor,
    context degrees: strategy.dp_replicate_size, dp_shard_size, tp_size, cp_size)."""
    out = {"world_size": world_size, "per_device_train_batch_size": per_device,
           "gradient_accumulation_steps": accumulation, "strategy": checkpoint_format(strategy),
           "nvme_optimizer": strategy == "zero_infinity"}
    if sequence_parallel > 1:
        out["sequence_parallel"] = sequence_parallel
    if expert_parallel > 1:  # each rank's experts and their optimizer state are its own (moe/mixin.py)
        out["expert_parallel"] = expert_parallel
    if mesh is not None:
        out["mesh"] = list(mesh)
    return out


def read_layout(path: str) -> dict | None:
    """The layout a checkpoint was written with; None without the file (written by something else: nothing to
    compare); CheckpointError naming the file when it exists but is not one."""
    f = os.path.join(path, LAYOUT)
    if not os.path.lexists(f):
        return None
    problem = layout_problem(path)
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}")
    with open(f, encoding="utf-8") as fh:
        return json.load(fh)


def layout_problem(path: str) -> str | None:
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
    mesh_problem = _mesh_problem(path, was, now)
    if mesh_problem:
        return problems + [mesh_problem]
    ep_was, ep_now = was.get("expert_parallel", 1), now.get("expert_parallel", 1)
    if ep_was != ep_now:
        problems.append(f"{path} was written with moe.expert_parallel_size {ep_was}, this run has {ep_now}: each "
                        "rank's experts keep their optimizer state in a file of its own; resume with "
                        f"moe.expert_parallel_size: {ep_was} on {ep_was} processes")
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


def _mesh_problem(path: str, was: dict, now: dict) -> str | None:
    """A checkpoint of a device mesh (HSDP, TP, CP) resumes on the same mesh only: its exactness is tested there, and
    nowhere else."""
    if not was.get("mesh") and not now.get("mesh"):
        return None  # plain data parallelism: the world size's own rules
    mesh_was = was.get("mesh") or [1, was["world_size"], 1, 1]  # plain: every rank a shard
    mesh_now = now.get("mesh") or [1, now["world_size"], 1, 1]
    if mesh_was == mesh_now:
        return None
    spelled = ", ".join(f"{k}: {v}" for k, v in zip(RECIPE_KEYS.values(), mesh_was))
    return (f"{path} was written on the device mesh {mesh_was} (replicate, shard, tensor, context), this run's is "
            f"{mesh_now}: a mesh's checkpoint resumes on the same mesh only; resume with strategy {spelled} on "
            f"{was['world_size']} processes")


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
