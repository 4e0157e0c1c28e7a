"""The `training:` section: TrainingArguments' own fields, spelled as transformers spells them, plus hftrain's few.

Types come from TrainingArguments' hints and the values are then checked by building a real TrainingArguments
(without touching devices or process groups), so its own rules apply and no default is copied here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
import functools
import os
import re
import typing
from typing import Any

import torch
from transformers import TrainingArguments

from ..constants import LossAveraging, LossImpl
from .schema import Ctx, check, type_name, unknown


def _option(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class HFTrainOptions:
    """hftrain's own `training:` keys, mixed into TrainingArguments (`HFTrainingArguments`) and TRL's configs, so that
    `training:` is one typed dataclass end to end and a trainer reads every option from `self.args`."""

    loss_averaging: LossAveraging = _option(
        "token",
        "token: mean CE over every target token of the global batch; sequence: mean over all sequences of the "
        "global batch of each sequence's mean CE. Both exact whatever the world size and accumulation.")
    overwrite_output_dir: bool = _option(
        False,
        "Train into an output_dir that holds a finished or unfinished run (its checkpoints and run_info.json are "
        "removed first) or files hftrain did not write. Off: such a folder is refused unless resuming.")
    resume_weights_only: bool = _option(
        False,
        "with resume_from_checkpoint: load the checkpoint's weights, step, data position and RNG, but start the "
        "optimizer state and the learning-rate schedule fresh (for a checkpoint whose optimizer.pt or scheduler.pt "
        "is missing or damaged). Not with DeepSpeed (ZeRO) strategies.")
    max_bad_steps: int = _option(
        0,
        "Optimizer steps with a non-finite loss or gradient norm that are skipped (gradients dropped, the update "
        "not applied; the LR schedule and step count still advance) before the run stops. 0: the first one stops "
        "the run, naming the step. Not under DeepSpeed (its engine steps inside backward) nor fp16.")
    loss_impl: LossImpl = _option(
        "auto",
        "How the loss's cross-entropy is computed (model.kernels does not choose it). chunked: hftrain's own, from the "
        "final hidden states and the output head over the target rows in chunks, never the full logits (the same "
        "loss and gradients, far less memory at large vocabularies); logits: from the model's logits; auto: chunked "
        "where the head is one it reproduces, else logits; fused: liger-kernel's fused linear cross-entropy over "
        "the target rows (asked for only, never by auto: CUDA, liger-kernel, loss_averaging token, a head at most "
        "soft-capped; refused elsewhere). The run says which in its 'hftrain: loss:' line.")
    # Set by the run from other sections of the recipe, never in `training:` (RUN_SET).
    strategy_name: str | None = _option(
        None, "The recipe's strategy: the engine built is checked against it before the first step (None: not).")
    compression: dict | None = _option(
        None, "The recipe's compression: section as a mapping (gradient compression on the data-parallel "
        "reduction); None: none.")
    part_learning_rates: dict | None = _option(
        None, "The recipe's model.part_learning_rates (an image model's parts at rates of their own); None: none.")


# HFTrainOptions fields the run fills in from other sections (strategy:, compression:), refused in `training:`.
RUN_SET = {"strategy_name": "set strategy.name", "compression": "set the compression: section",
           "part_learning_rates": "set model.part_learning_rates"}
HFTRAIN_TRAINING_KEYS = tuple(f.name for f in dataclasses.fields(HFTrainOptions) if f.name not in RUN_SET)


@dataclasses.dataclass
class HFTrainingArguments(TrainingArguments, HFTrainOptions):
    """TrainingArguments with hftrain's options: what every hftrain trainer is given as `args`."""


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
    **{f.name: f.default for f in dataclasses.fields(HFTrainOptions) if f.name not in RUN_SET},
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
# Keys read by hftrain itself rather than by the trainer (resolved to one checkpoint path at set-up).
NOT_ARGUMENTS = {"resume_from_checkpoint"}


@functools.cache
def _training_fields() -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    hints = typing.get_type_hints(HFTrainingArguments)
    return hints, {f.name: f for f in dataclasses.fields(HFTrainingArguments) if f.init and f.name not in RUN_SET}


def training_value(training: dict, name: str):
    """The value the run will use: the recipe's (with hftrain's defaults), else TrainingArguments' default."""
    if name in training:
        return training[name]
    f = _training_fields()[1][name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True)
class TrainingValues:
    """The `training:` values hftrain's own code reads, typed, as the run will see them (training_value: the recipe's,
    with hftrain's defaults, else TrainingArguments' own), read by attribute instead of by string key
    (Recipe.typed_training). Every other key goes to TrainingArguments untouched. A rule that asks what the user
    wrote (a key present or not) reads recipe.training itself."""

    output_dir: str | None
    seed: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    dataloader_drop_last: bool
    eval_strategy: str
    train_sampling_strategy: str
    optim: str
    use_cpu: bool
    bf16: bool | None
    fp16: bool
    resume_from_checkpoint: str | bool | None
    resume_weights_only: bool
    overwrite_output_dir: bool
    loss_averaging: str
    loss_impl: str
    max_bad_steps: int
    include_num_input_tokens_seen: str | bool
    ddp_find_unused_parameters: bool | None
    save_only_model: bool
    save_strategy: str


def typed_values(training: dict) -> TrainingValues:
    """TrainingValues of a recipe's `training:` section."""
    return TrainingValues(**{f.name: training_value(training, f.name) for f in dataclasses.fields(TrainingValues)})


def validate_training(raw: dict, ctx: Ctx) -> dict:
    """hftrain's defaults merged with the recipe's keys, each type-checked against TrainingArguments' hints."""
    hints, fields = _training_fields()
    merged = dict(TRAINING_DEFAULTS)
    for name, value in raw.items():
        key = f"training.{name}"
        if name in TRAINING_REFUSED:
            ctx.add(key, f"not accepted here: {TRAINING_REFUSED[name]}")
            continue
        if name in RUN_SET:
            ctx.add(key, f"not accepted here: {RUN_SET[name]} (hftrain fills it in from that section)")
            continue
        if name not in fields:
            unknown(key, str(name), sorted(set(fields) - set(TRAINING_REFUSED)), ctx)
            continue
        tp = hints.get(name, Any)
        if name == "resume_from_checkpoint":
            tp = str | bool | None  # true = the newest checkpoint in output_dir
        ok, conv = check(value, tp, key, ctx)
        if not ok:
            ctx.add(key, f"expected {type_name(tp)}, got {value!r}")
        elif name in PATH_KEYS and isinstance(conv, str) and conv:
            conv = normalise_path(conv, key, ctx)
        merged[name] = conv
    if not isinstance(merged.get("output_dir"), str) or not merged["output_dir"]:
        ctx.add("training.output_dir", "must be a folder path" + (
            " (YAML reads a bare ~ as null: write the folder out, e.g. ~/runs/my-run)"
            if "output_dir" in raw and raw["output_dir"] is None else ""))
    elif "output_dir" not in raw:
        merged["output_dir"] = normalise_path(merged["output_dir"], "training.output_dir", ctx)
    return merged


# Paths of `training:` that name folders of this machine: normalised once, when the recipe is read, so that the
# lock, the checks, the saves and TrainingArguments (which expands `~` itself) all use one and the same folder.
PATH_KEYS = ("output_dir", "logging_dir", "resume_from_checkpoint")
_UNSET_VARIABLE = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def normalise_path(value: str, key: str, ctx: Ctx) -> str:
    """`~`, `~user` and environment variables expanded, then made absolute against the working folder. A variable
    that is not set is a problem (os.path.expandvars would leave `$NAME` in the path, a folder named `$NAME`)."""
    expanded = os.path.expandvars(os.path.expanduser(value))
    unset = _UNSET_VARIABLE.search(expanded)
    if unset:
        ctx.add(key, f"{value}: the environment variable {unset.group(0)} is not set; set it, or write the path out")
        return value
    return os.path.abspath(expanded)


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
    for precision in ("bf16", "fp16"):
        # TRL's configs turn bf16 on when neither is set (trl's _BaseConfig.__post_init__): the recipe's value, or
        # TrainingArguments' default (off) that `training_value` reports, must be the one a TRL trainer runs with.
        kwargs.setdefault(precision, training_value(recipe.training, precision))
    if "use_cpu" not in kwargs and not accelerator:
        # Without it a GPU-less multi-process launch silently trains world-size-1 copies.
        kwargs["use_cpu"] = True
    return kwargs


def arguments_problem(kwargs: dict) -> str | None:
    """TrainingArguments' own verdict on these keywords (e.g. the eval/save strategies load_best_model_at_end
    needs), from a real TrainingArguments built without resolving its device (which would start the process group)
    and without the launcher's DeepSpeed variables (which would register a DeepSpeed config globally)."""
    try:
        with _without_environ(("ACCELERATE_USE_", "ACCELERATE_DEEPSPEED")):
            _DeviceFreeArguments(**kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
        return " ".join(str(e).split()) or type(e).__name__
    return None


@contextlib.contextmanager
def _without_environ(prefixes: tuple[str, ...]):
    """os.environ without the variables starting with `prefixes` for the block, restored after it."""
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith(prefixes)]}
    try:
        yield
    finally:
        os.environ.update(saved)


@dataclasses.dataclass
class _DeviceFreeArguments(HFTrainingArguments):
    """TrainingArguments whose `device` is not resolved: resolving it starts the process group."""

    @property
    def device(self):
        return torch.device("cpu")
