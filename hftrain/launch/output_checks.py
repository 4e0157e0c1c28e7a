"""The run's output_dir and the checkpoint it resumes from, checked before anything is written or loaded: a writable
folder of its own, outside the folders the run reads, owned by this run; a checkpoint this run's layout, model,
vocabulary and adapter can resume exactly (launch.resume)."""

from __future__ import annotations

import os

from .. import checkpoints, outdir
from ..config import Recipe, StrategySection
from ..config.fields import is_of_type
from ..data.stream_position import stream_resume_problems
from ..distributed import restart_count
from ..modeling import load_tokenizer
from .machine import unwritable
from .resume import compatibility_problems


def protected_folders(recipe: Recipe) -> dict[str, str]:
    """The folders a run reads from that its output_dir must not be, hold or lie in: description -> path."""
    m = recipe.model
    reads = {"model.name_or_path": getattr(m, "name_or_path", None),
             "model.tokenizer_name_or_path": getattr(m, "tokenizer_name_or_path", None)}
    return {f"{key}'s folder": p for key, p in reads.items() if isinstance(p, str) and os.path.isdir(p)}


def output_dir_problems(path: str, protected: dict[str, str] | None = None) -> list[str]:
    """output_dir is a folder of its own (guarded_folder_problem), and it, or the folder it will be created in, is
    writable. Nothing is created here: a refused run leaves nothing behind."""
    guarded = outdir.guarded_folder_problem(path, protected)
    if guarded:
        return [guarded]
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"training.output_dir: {path} cannot be created: {parent} is not a folder; choose another path"]
    why = unwritable(parent)
    if why:
        return [f"training.output_dir: cannot write in {parent} ({why}); fix its permissions or choose another folder"]
    return []


def resume_problems(value, output_dir: str, layout: dict | None = None, weights_only: bool = False,
                    recipe: Recipe | None = None, warn=lambda _m: None) -> list[str]:
    """training.resume_from_checkpoint names (or, when true, finds) a complete checkpoint that this run's layout
    (checkpoints.layout) can resume exactly and, with `recipe`, of the model, vocabulary and LoRA adapter the recipe
    builds (launch.resume): checked before any model is loaded, not minutes later in train(). `warn` hears what is
    accepted with a caveat (a checkpoint without a manifest, and who wrote it)."""
    try:
        path = checkpoints.resolve_resume(value, output_dir, warn=warn, weights_only=weights_only)
        if layout is not None:
            checkpoints.check_layout(path, layout)
    except checkpoints.CheckpointError as e:
        return [str(e)]
    if path is None or recipe is None or recipe.model is None:
        return []
    streams = stream_resume_problems(path, recipe.data) if recipe.data is not None else []
    return compatibility_problems(path, recipe, load_tokenizer=lambda m: load_tokenizer(m)) + streams


def output_problems(recipe: Recipe, strategy: StrategySection, world: int, skip: set[str], model_ok: bool,
                     warn) -> list[tuple[str, str]]:
    """output_dir: writable, outside the inputs, owned by this run; the checkpoint to resume against this layout."""
    output_dir = recipe.typed_training.output_dir
    if not (is_of_type(output_dir, str) and output_dir and "training.output_dir" not in skip):
        return []
    where = output_dir_problems(output_dir, protected_folders(recipe) if model_ok else {})
    if not where and "training.overwrite_output_dir" not in skip:
        resume = bool(recipe.resume_from_checkpoint) or restart_count() > 0
        owned = outdir.ownership_problem(output_dir, resume, bool(recipe.typed_training.overwrite_output_dir))
        where = [owned] if owned else []
    out = [("training.output_dir", msg) for msg in where]
    if "training.resume_from_checkpoint" not in skip:
        sp = strategy.sequence_parallel if is_of_type(strategy.sequence_parallel, int) else 1
        ep = recipe.moe.expert_parallel_size if recipe.moe and is_of_type(recipe.moe.expert_parallel_size, int) else 1
        mesh = strategy.mesh()
        degrees = mesh.degrees if mesh.beyond_sharding else None
        now = checkpoints.layout(world, recipe.typed_training.per_device_train_batch_size,
                                 recipe.typed_training.gradient_accumulation_steps, strategy.name, sp, ep, degrees)
        out += [("training.resume_from_checkpoint", msg)
                for msg in resume_problems(recipe.resume_from_checkpoint, output_dir, now,
                                           recipe.typed_training.resume_weights_only is True,
                                           recipe if model_ok else None, warn)]
    return out
