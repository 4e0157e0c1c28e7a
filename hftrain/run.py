"""The glue around one training run: launcher checks, the files a run leaves, the final save."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch

from . import checkpoints, distributed
from .fileio import atomic_write
from .engine import SHARDED, LaunchError, describe
from .recipe import Recipe, StrategySection

RECIPE_FILE = "recipe.yaml"
RUN_INFO_FILE = "run_info.json"


def check_world_size(args) -> None:
    """Stop before any model is loaded when the processes are not what the launcher says."""
    expected = distributed.launcher_world_size()
    if args.world_size != expected:
        raise LaunchError(
            f"the launcher started {expected} processes but training sees a world of {args.world_size}: the ranks "
            "would train separate copies. On a machine without GPU leave training.use_cpu unset (hftrain sets it) "
            "and launch with torchrun or a MULTI_GPU accelerate config"
        )


def check_batch(args, n_examples: int) -> None:
    """One optimizer step takes world x micro-batch x accumulation examples; fewer than that trains nothing."""
    need = args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    if args.dataloader_drop_last and n_examples < need:  # without drop_last a short step still trains
        raise LaunchError(
            f"one optimizer step needs {need} examples ({args.world_size} processes x per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps {args.gradient_accumulation_steps}) "
            f"and dataloader_drop_last drops them all: the data has {n_examples}. Lower one of those or add data"
        )


def write_recipe(recipe: Recipe) -> None:
    """The resolved recipe (defaults + YAML + command line) in output_dir/recipe.yaml."""
    if distributed.is_main_process():
        os.makedirs(recipe.output_dir, exist_ok=True)
        atomic_write(os.path.join(recipe.output_dir, RECIPE_FILE), recipe.to_yaml())


def write_strategy_configs(recipe: Recipe, strategy: StrategySection) -> None:
    """The accelerate config (and DeepSpeed JSON) of this run, rendered from the recipe, in output_dir."""
    if distributed.is_main_process():
        from .compression import zero_communication_dtype
        from .strategies import render

        render(strategy, recipe.output_dir, recipe.training,
               communication_data_type=zero_communication_dtype(recipe.compression))


def weights_digest(model) -> str:
    """sha256 over every parameter and buffer, in name order: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


PROBE_IDS = [[1, 5, 9, 13, 17, 21, 25, 29]]  # a fixed input whose logits run_info.json records


@torch.no_grad()
def probe_logits(trainer) -> list:
    """Logits of the trained model on PROBE_IDS, through the engine that trained it (every rank takes part)."""
    model = trainer.model_wrapped
    was_training = model.training
    model.eval()
    ids = torch.tensor(PROBE_IDS, device=trainer.args.device) % trainer.model.config.vocab_size
    logits = model(input_ids=ids).logits.float().cpu()
    model.train(was_training)
    return logits.tolist()


def run_info(trainer, strategy: StrategySection) -> dict:
    """What actually ran: world size, backend, engine, per-rank weight digests (replicated strategies), probe logits."""
    import torch.distributed as dist

    replicated = strategy.name not in SHARDED
    return {
        "world_size": trainer.args.world_size,
        "launcher_world_size": distributed.launcher_world_size(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "distributed_type": str(trainer.accelerator.distributed_type),
        **describe(trainer, strategy),
        "rank_weight_digests": distributed.all_gather_object(weights_digest(trainer.model)) if replicated else None,
        "probe_logits": probe_logits(trainer),
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
    if digests and len(set(digests)) != 1:
        raise LaunchError(
            f"the {len(digests)} ranks hold different weights after training (wrapper: {info['wrapper']}): "
            "gradients were not synchronised, the saved model is one rank's copy. Please report this with run_info.json"
        )


def save_final(trainer, recipe: Recipe, strategy: StrategySection, tokenizer, metrics: dict) -> dict:
    """Consolidated safetensors + tokenizer in output_dir, final trainer_state.json, run_info.json, merged LoRA."""
    out = recipe.output_dir
    if strategy.name == "fsdp":
        # Sharded state dicts make checkpoints fast, but save_model() would write no weights with them.
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    # model.safetensors (or the adapter), tokenizer and chat template: written aside, then moved in file by file.
    staged = os.path.join(checkpoints.staging_root(out), "final")
    if distributed.is_main_process() and os.path.lexists(staged):
        shutil.rmtree(staged)
    distributed.barrier()
    try:
        trainer.save_model(staged)
    except Exception as e:
        error = checkpoints.save_failure(e, staged, out)
        if distributed.is_main_process():
            shutil.rmtree(staged, ignore_errors=True)
            checkpoints.remove_staging_root(os.path.dirname(staged))
        raise error from e
    distributed.barrier()
    if distributed.is_main_process():
        checkpoints.publish_into(staged, out)
    distributed.barrier()
    trainer.save_state()
    info = run_info(trainer, strategy)
    info["metrics"] = metrics
    if distributed.is_main_process():
        if recipe.model.lora is not None and recipe.model.lora.merge:
            from .modeling import save_merged

            save_merged(trainer.model, tokenizer, out)
        atomic_write(os.path.join(out, RUN_INFO_FILE), json.dumps(info, indent=2) + "\n")
    distributed.barrier()
    check_ranks_agree(info)
    return info
