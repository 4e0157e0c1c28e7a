"""Where a frozen model a method holds (a teacher, a reference, a reward model) goes: placed as the strategy places
the policy, so that the memory plan's count (launch/plan.py: sharded like the policy) is what the run holds.

- ZeRO-3: a DeepSpeed inference engine partitioning it over the ranks (TRL's prepare_deepspeed, as its own trainers
  place their reference and teacher models);
- FSDP2: accelerate's own FSDP2 preparation of the policy (each decoder layer a unit, the embeddings and head, then
  the root), from the CPU: each unit is moved to the device and sharded in turn. Written here rather than TRL's
  prepare_fsdp, which shards the whole model as one unit: every forward then gathered the whole model on each device
  (a teacher sized for 8-way FSDP2 passed the plan and ran out of memory);
- otherwise (DDP, one process): whole on the rank's device.
"""

from __future__ import annotations

from accelerate.utils import fsdp2_prepare_model
from trl.models import prepare_deepspeed

from ..distributed import print0
from ..modeling.wrap_classes_and_renamings import keep_present_no_split_modules


class FrozenModelsMixin:
    """A trainer holding frozen models beside its policy (`frozen`: {key: model}, as Method.load_others loads them):
    each placed once the trainer is built, as its strategy places the policy (place_frozen), how said under its key;
    `self.frozen[key]` is the placed model. Frozen, so none reaches the optimizer."""

    def __init__(self, *args, frozen: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.frozen = {key: placed_and_said(key, model, self) for key, model in (frozen or {}).items()}


def placed_and_said(key: str, model, trainer):
    """`model` placed for `trainer` (place_frozen), what rank 0 holds of it said under its recipe `key`."""
    model, how = place_frozen(model, trainer)
    say_placed(key, model, how)
    return model


def reference_per_layer(model, accelerator):
    """A TRL trainer's frozen reference copy under FSDP2, sharded per layer as the policy (patches/trl.py routes
    TRL's prepare_fsdp here: it shards the whole model as one unit), and said."""
    keep_present_no_split_modules(model)  # TRL loaded it, not modeling.load_model: LLaVA named a class it lacks
    model = sharded_per_layer(model, accelerator)
    say_placed("the reference (a frozen copy of model)", model, "fully_shard per layer (FSDP2, as the policy)")
    return model


def say_placed(key: str, model, how: str) -> None:
    held, total, unit = *held_parameters(model), largest_gathered(model)
    print0(f"hftrain: {key}: placed by {how}: rank 0 holds {held:,} of its {total:,} parameters"
           + (f", at most {unit:,} gathered at once" if unit is not None else ""))


def held_parameters(model) -> tuple[int, int]:
    """(parameters this rank stores, parameters of the model): a DTensor's local shard (FSDP2), a ZeRO-3 parameter's
    partition (ds_tensor; ds_numel its full size), else the whole tensor."""
    held = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            held, total = held + p.ds_tensor.numel(), total + p.ds_numel
        else:
            held += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
            total += p.numel()
    return held, total


def place_frozen(model, trainer):
    """(the frozen `model` placed for `trainer`'s strategy, how it was placed, in words)."""
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(model, trainer.accelerator), "a DeepSpeed inference engine (ZeRO-3 partitions)"
    if trainer.is_fsdp_enabled:
        return sharded_per_layer(model, trainer.accelerator), "fully_shard per layer (FSDP2, as the policy)"
    return model.to(trainer.args.device), "whole on each rank"


def sharded_per_layer(model, accelerator):
    """fsdp2_prepare_model on the frozen model; the plugin's wrap policy put back after it: accelerate sets it from the
    model it prepares, and the policy, prepared later, may be of another family."""
    plugin = accelerator.state.fsdp_plugin
    saved = plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap
    try:
        model = fsdp2_prepare_model(accelerator, model)
    finally:
        plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap = saved
    return model.eval()


def largest_gathered(model) -> int | None:
    """The most parameters one FSDP2 unit of `model` gathers for its forward (a fully_shard'ed module's parameters
    less those of the units inside it); None where FSDP2 does not shard it."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    sizes = []
    for unit in units:
        inner = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                 for p in sub.parameters()}
        sizes.append(sum(p.numel() for p in unit.parameters() if id(p) not in inner))
    return max(sizes)
