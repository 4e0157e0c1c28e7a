"""The `training:` section: TrainingArguments' own fields, spelled as transformers spells them, plus hftrain's few.

Types come from TrainingArguments' hints and the values are then checked by building a real TrainingArguments
(without touching devices or process groups), so its own rules apply and no default is copied here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from typing import Any
from unittest import mock

import torch
from transformers import TrainingArguments

from ..constants import LossAveraging, LossImpl
from .schema import Ctx, check, type_name, unknown

# Keys of `training:` that hftrain adds to TrainingArguments' own: (type, default, help).
HFTRAIN_TRAINING_KEYS: dict[str, tuple[Any, Any, str]] = {
    "loss_averaging": (
        LossAveraging,
        "token",
        "token: mean CE over every target token of the global batch; sequence: mean over all sequences of the "
        "global batch of each sequence's mean CE. Both exact whatever the world size and accumulation.",
    ),
    "overwrite_output_dir": (
        bool,
        False,
        "Train into an output_dir that holds a finished or unfinished run (its checkpoints and run_info.json are "
        "removed first) or files hftrain did not write. Off: such a folder is refused unless resuming.",
    ),
    "resume_weights_only": (
        bool,
        False,
        "with resume_from_checkpoint: load the checkpoint's weights, step, data position and RNG, but start the "
        "optimizer state and the learning-rate schedule fresh (for a checkpoint whose optimizer.pt or scheduler.pt "
        "is missing or damaged). Not with DeepSpeed (ZeRO) strategies.",
    ),
    "max_bad_steps": (
        int,
        0,
        "Optimizer steps with a non-finite loss or gradient norm that are skipped (gradients dropped, the update "
        "not applied; the LR schedule and step count still advance) before the run stops. 0: the first one stops "
        "the run, naming the step. Not under DeepSpeed (its engine steps inside backward) nor fp16.",
    ),
    "loss_impl": (
        LossImpl,
        "auto",
        "chunked: the CE from the final hidden states and the output head in chunks of tokens, never the full logits "
        "(the same loss and gradients, far less memory at large vocabularies); logits: from the model's logits; "
        "auto: chunked where supported (not under fsdp or ZeRO-3, nor with a head it cannot reproduce), else logits.",
    ),
}
# hftrain's defaults where they differ from TrainingArguments', overridden by the recipe's `training:` section.
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/hftrain",
    "report_to": ["tensorboard"],
    "logging_steps": 10,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": 2,
    # All parameters take part in every step of a causal LM; True costs an extra all-reduce per step.
    "ddp_find_unused_parameters": False,
    **{k: v[1] for k, v in HFTRAIN_TRAINING_KEYS.items()},
}
# TrainingArguments fields the recipe owns elsewhere, or must never hold.
TRAINING_REFUSED = {
    "push_to_hub": "set hub.push: true and hub.repo_id: hftrain validates the folder before it uploads it",
    "hub_token": "the Hub token is read from HF_TOKEN or `hf auth login`, never from a recipe (it would be saved "
    "with the run)",
    "gradient_checkpointing": "set model.gradient_checkpointing instead",
    "activation_checkpointing": "set model.gradient_checkpointing instead",
    "average_tokens_across_devices": "hftrain always normalises the loss over the global batch "
    "(training.loss_averaging)",
    "use_liger_kernel": "Liger's fused loss returns no logits and bypasses hftrain's loss normalisation",
    "deepspeed": "set strategy.name (zero1 ... zero_infinity) and its options: hftrain generates the DeepSpeed "
    "config, with every value TrainingArguments owns as \"auto\" so that nothing rescales the loss twice",
    "fsdp": "set strategy.name: fsdp and its options (strategy.fsdp_*)",
    "fsdp_config": "set strategy.name: fsdp and its options (strategy.fsdp_*)",
}
# Keys read by hftrain (not TrainingArguments fields, or passed to train() rather than to TrainingArguments).
NOT_ARGUMENTS = {"resume_from_checkpoint", *HFTRAIN_TRAINING_KEYS}


@functools.cache
def _training_fields() -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    hints = typing.get_type_hints(TrainingArguments)
    return hints, {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}


def training_value(training: dict, name: str):
    """The value the run will use: the recipe's (with hftrain's defaults), else TrainingArguments' default."""
    if name in training:
        return training[name]
    f = _training_fields()[1][name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def validate_training(raw: dict, ctx: Ctx) -> dict:
    """hftrain's defaults merged with the recipe's keys, each type-checked against TrainingArguments' hints."""
    hints, fields = _training_fields()
    merged = dict(TRAINING_DEFAULTS)
    for name, value in raw.items():
        key = f"training.{name}"
        if name in TRAINING_REFUSED:
            ctx.add(key, f"not accepted here: {TRAINING_REFUSED[name]}")
            continue
        if name not in fields and name not in HFTRAIN_TRAINING_KEYS:
            unknown(key, str(name), sorted((set(fields) | set(HFTRAIN_TRAINING_KEYS)) - set(TRAINING_REFUSED)), ctx)
            continue
        tp = HFTRAIN_TRAINING_KEYS[name][0] if name in HFTRAIN_TRAINING_KEYS else hints.get(name, Any)
        if name == "resume_from_checkpoint":
            tp = str | bool | None  # true = the newest checkpoint in output_dir
        ok, conv = check(value, tp, key, ctx)
        if not ok:
            ctx.add(key, f"expected {type_name(tp)}, got {value!r}")
        merged[name] = conv
    if not isinstance(merged.get("output_dir"), str) or not merged["output_dir"]:
        ctx.add("training.output_dir", "must be a folder path")
    return merged


def arguments_kwargs(recipe, accelerator: bool) -> dict:
    """TrainingArguments keywords for a recipe, before the strategy's additions (launch.setup adds those)."""
    kwargs = {k: v for k, v in recipe.training.items() if k not in NOT_ARGUMENTS}
    kwargs["activation_checkpointing"] = recipe.model.gradient_checkpointing
    if "include_num_input_tokens_seen" not in kwargs:
        # With packing there is no attention_mask and pad may equal eos: count every token.
        kwargs["include_num_input_tokens_seen"] = "all" if recipe.data.packing else "non_padding"
    if "eval_on_start" not in kwargs and (recipe.data.eval_sources or recipe.data.eval_fraction > 0):
        # The "before" eval loss must come from inside train(): a trainer.evaluate() before train() marks the model
        # prepared and train() then skips the DDP wrap (transformers 5.23, accelerate 1.15).
        kwargs["eval_on_start"] = True
    if recipe.data.streaming is True:
        # Each process reads its own share of the stream (data/stream.py): accelerate's default for an iterable
        # dataset would have the main process read every batch and send the others theirs.
        config = kwargs.get("accelerator_config")
        kwargs["accelerator_config"] = {**(config if isinstance(config, dict) else {}), "dispatch_batches": False}
    if "use_cpu" not in kwargs and not accelerator:
        # Without it a GPU-less multi-process launch silently trains world-size-1 copies.
        kwargs["use_cpu"] = True
    return kwargs


def arguments_problem(kwargs: dict) -> str | None:
    """TrainingArguments' own verdict on these keywords (e.g. the eval/save strategies load_best_model_at_end
    needs), from a real TrainingArguments built without resolving its device (which would start the process group)
    and without the launcher's DeepSpeed variables (which would register a DeepSpeed config globally)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_USE_", "ACCELERATE_DEEPSPEED"))}
    try:
        with mock.patch.dict(os.environ, env, clear=True):
            _DeviceFreeArguments(**kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
        return " ".join(str(e).split()) or type(e).__name__
    return None


@dataclasses.dataclass
class _DeviceFreeArguments(TrainingArguments):
    """TrainingArguments whose `device` is not resolved: resolving it starts the process group."""

    @property
    def device(self):
        return torch.device("cpu")
