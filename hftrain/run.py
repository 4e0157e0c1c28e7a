"""The glue around one training run: launcher checks, the files a run leaves, the final save."""

from __future__ import annotations

import hashlib
import json
import os

import torch

from . import distributed
from .recipe import Recipe

RECIPE_FILE = "recipe.yaml"
RUN_INFO_FILE = "run_info.json"


class LaunchError(RuntimeError):
    pass


def launcher_strategy() -> str:
    """The strategy family the launcher set up, from the environment accelerate's launcher exports."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return f"zero{env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '')}"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    return "ddp"


def check_launch(args, recipe: Recipe) -> None:
    """Stop before any model is loaded when the processes are not what the launcher and the recipe say."""
    expected = distributed.launcher_world_size()
    if args.world_size != expected:
        raise LaunchError(
            f"the launcher started {expected} processes but training sees a world of {args.world_size}: the ranks "
            "would train separate copies. On a machine without GPU leave training.use_cpu unset (hftrain sets it) "
            "and launch with torchrun or a MULTI_GPU accelerate config"
        )
    wanted = recipe.strategy.name
    have = launcher_strategy()
    if wanted is None:
        return
    family = "zero" if wanted.startswith("zero") else wanted
    if not have.startswith(family) or (family == "zero" and wanted[4:5].isdigit() and have != wanted[:5]):
        raise LaunchError(
            f"{recipe.source}: strategy.name is '{wanted}' but the launcher set up '{have}'. Launch with the "
            f"accelerate config for '{wanted}', or change strategy.name to '{have}' (or remove it to let the "
            "launcher decide)"
        )


def atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_recipe(recipe: Recipe) -> None:
    """The resolved recipe (defaults + YAML + command line) in output_dir/recipe.yaml."""
    if distributed.is_main_process():
        os.makedirs(recipe.output_dir, exist_ok=True)
        atomic_write(os.path.join(recipe.output_dir, RECIPE_FILE), recipe.to_yaml())


def weights_digest(model) -> str:
    """sha256 over every parameter and buffer, in name order: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_info(trainer) -> dict:
    """What actually ran: world size, backend, the wrapper around the model, per-rank weight digests."""
    import torch.distributed as dist

    return {
        "world_size": trainer.args.world_size,
        "launcher_world_size": distributed.launcher_world_size(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapper": type(trainer.model_wrapped).__name__,
        "rank_weight_digests": distributed.all_gather_object(weights_digest(trainer.model)),
        "global_step": trainer.state.global_step,
    }


def first_eval(log_history: list[dict]) -> dict:
    """The eval loss logged at step 0 (eval_on_start), if any."""
    for h in log_history:
        if "eval_loss" in h and h.get("step") == 0:
            return {"eval_loss": h["eval_loss"]}
    return {}


def check_ranks_agree(info: dict) -> None:
    """Data parallelism means every rank ends with the same weights; anything else is a silent fallback."""
    digests = info["rank_weight_digests"]
    if info["world_size"] > 1 and launcher_strategy() == "ddp" and len(set(digests)) != 1:
        raise LaunchError(
            f"the {len(digests)} ranks hold different weights after training (wrapper: {info['wrapper']}): "
            "gradients were not synchronised, the saved model is one rank's copy. Please report this with run_info.json"
        )


def save_final(trainer, recipe: Recipe, tokenizer, metrics: dict) -> dict:
    """Consolidated safetensors + tokenizer in output_dir, final trainer_state.json, run_info.json, merged LoRA."""
    out = recipe.output_dir
    trainer.save_model(out)  # model.safetensors (or the adapter), tokenizer and chat template
    trainer.save_state()
    info = run_info(trainer)
    info["metrics"] = metrics
    if distributed.is_main_process():
        if recipe.model.lora is not None and recipe.model.lora.merge:
            from .modeling import save_merged

            save_merged(trainer.model, tokenizer, out)
        atomic_write(os.path.join(out, RUN_INFO_FILE), json.dumps(info, indent=2) + "\n")
    distributed.barrier()
    check_ranks_agree(info)
    return info
