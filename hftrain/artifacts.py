"""What a run writes beside the model: the resolved recipe, run_info.json (what actually ran), curves.png, and the
final save itself (staged, then published)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from . import checkpoints, distributed, fileio, guards
from .config import Recipe, StrategySection
from .constants import PROBE_IDS, RECIPE_FILE, RUN_INFO_FILE, SHARDED, ZERO_STAGE
from .errors import LaunchError
from .fileio import atomic_write, pyplot, save_figure
from .modeling import loading_outside_zero3, save_merged

CURVES_FILE = "curves.png"


def plot_curves(log_history: list[dict], path: str) -> str | None:
    """Train/eval loss, learning rate, tokens/s (and preference rewards, GRPO's rewards, KL, clipping, completion length
    and advantages) against the step, as one PNG, four panels a row. None when nothing was logged."""
    plt = pyplot()

    def series(key):
        pts = [(h["step"], h[key]) for h in log_history if key in h and "step" in h]
        return [p[0] for p in pts], [p[1] for p in pts]

    panels = [
        ("loss", [("loss", "train"), ("eval_loss", "eval")]),
        ("learning rate", [("learning_rate", None)]),
        ("tokens/s", [("train_tokens_per_second", None)]),
        # preference tuning (TRL's metrics): rewards and how often chosen beats rejected, train and held out
        ("rewards", [("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("rewards/margins", "margin"),
                     ("eval_rewards/margins", "eval margin")]),
        ("reward accuracy", [("rewards/accuracies", "train"), ("eval_rewards/accuracies", "eval")]),
        # GRPO (TRL's metrics, hftrain's advantages): the weighted reward and each function's mean
        ("reward", [("reward", "weighted sum")] + sorted({(k, k.split("/")[1]) for h in log_history for k in h
                                                          if k.startswith("rewards/") and k.endswith("/mean")})),
        ("KL to the reference", [("kl", None)]),
        ("clipped tokens", [("clip_ratio/region_mean", None)]),
        ("completion length", [("completions/mean_length", "mean"), ("completions/max_length", "max")]),
        ("advantage", [("advantages/abs_mean", "mean |A|"), ("advantages/std", "std")]),
    ]
    panels = [(t, [(k, lbl) for k, lbl in keys if series(k)[0]]) for t, keys in panels]
    panels = [(t, keys) for t, keys in panels if keys]
    if not panels:
        return None
    cols, rows = min(4, len(panels)), -(-len(panels) // 4)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, keys) in zip(axes.flat, panels):
        for key, label in keys:
            x, y = series(key)
            ax.plot(x, y, marker="o" if len(x) < 20 else None, markersize=3, label=label or key)
        ax.set_title(title)
        ax.set_xlabel("step")
        if any(lbl for _, lbl in keys):
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


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


@torch.no_grad()
def probe_logits(trainer) -> list:
    """Logits of the trained model on PROBE_IDS, through the engine that trained it (every rank takes part)."""
    model = trainer.model_wrapped
    was_training = model.training
    model.eval()
    # the language model's vocabulary (a vision-language model's config holds it in its text config)
    vocab = trainer.model.config.get_text_config().vocab_size
    ids = torch.tensor(PROBE_IDS, device=trainer.args.device) % vocab
    logits = model(input_ids=ids).logits.float().cpu()
    model.train(was_training)
    return logits.tolist()


def run_info(trainer, strategy: StrategySection) -> dict:
    """What actually ran: world size, backend, engine, per-rank weight digests (replicated strategies), probe logits."""
    replicated = strategy.name not in SHARDED and strategy.resolved_tensor_parallel() == 1
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


def describe(trainer, strategy: StrategySection) -> dict:
    """What engine actually trained: for tests and for run_info.json."""
    wrapped = trainer.model_wrapped
    out = {"strategy": strategy.name, "wrapper": type(wrapped).__name__,
           "mesh": distributed.mesh_degrees(trainer.accelerator)}  # [replicate, shard, tensor, context] or None
    if strategy.name in ZERO_STAGE:
        out["zero_stage"] = wrapped.zero_optimization_stage()
        out["offload_optimizer"] = str(getattr(wrapped.zero_offload_optimizer(), "device", None) or "none")
        out["offload_param"] = str(getattr(wrapped.zero_offload_param(), "device", None) or "none")
        out["communication_dtype"] = str(wrapped.communication_data_type)
        opt = wrapped.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: is the fp32 master its own copy of the weights?
            shared = all(a is b for a, b in zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat))
            out["fp32_master"] = "the weights" if shared else "a copy"
    if strategy.name == "fsdp":
        out["fsdp2_modules"] = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
        root = trainer.model if isinstance(trainer.model, FSDPModule) else None
        out["fsdp_reduce_dtype"] = str(root._get_fsdp_state()._mp_policy.reduce_dtype) if root is not None else None
    return out


def first_eval(log_history: list[dict], keys: tuple[str, ...] = ("eval_loss",)) -> dict:
    """The held-out metrics `keys` before training (eval_on_start's evaluation at step 0), those logged."""
    for h in log_history:
        if "eval_loss" in h and h.get("step") == 0:
            return {k: h[k] for k in keys if k in h}
    return {}


def check_ranks_agree(info: dict) -> None:
    """Data parallelism means every rank ends with the same weights; anything else is a silent fallback."""
    digests = info["rank_weight_digests"]
    if digests and len(set(digests)) != 1:
        raise LaunchError(
            f"the {len(digests)} ranks hold different weights after training (wrapper: {info['wrapper']}): "
            "gradients were not synchronised, the saved model is one rank's copy. Please report this with run_info.json"
        )


def save_final(trainer, recipe: Recipe, strategy: StrategySection, tokenizer, metrics: dict,
               method: dict | None = None) -> dict:
    """Consolidated safetensors + tokenizer in output_dir, final trainer_state.json, run_info.json, merged LoRA.
    `method`: the method that trained, as the model card names it (methods.Method.card)."""
    out = recipe.output_dir
    guards.check_finite_weights(trainer.model, "the final model")  # every rank its shards; nothing written yet
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
            fileio.remove_staging_root(os.path.dirname(staged))
        raise error from e
    distributed.barrier()
    if distributed.is_main_process():
        fileio.publish_into(staged, out)
    distributed.barrier()
    trainer.save_state()
    info = run_info(trainer, strategy)
    info["metrics"] = metrics
    if method is not None:
        info["method"] = method
    if distributed.is_main_process():
        if recipe.model.lora is not None and recipe.model.lora.merge:
            with loading_outside_zero3(trainer.args):
                # the trainer's processing class: a vision-language model's processor (its merged/ held none)
                save_merged(trainer.model, trainer.processing_class or tokenizer, out, recipe.model,
                            sharded=strategy.name in SHARDED)
        atomic_write(os.path.join(out, RUN_INFO_FILE), json.dumps(info, indent=2) + "\n")
    distributed.barrier()
    check_ranks_agree(info)
    return info
