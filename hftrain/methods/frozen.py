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


def place_frozen(model, trainer):
    """(the frozen `model` placed for `trainer`'s strategy, how it was placed, in words)."""
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(model, trainer.accelerator), "a DeepSpeed inference engine (ZeRO-3 partitions)"
    if trainer.is_fsdp_enabled:
        return _sharded_per_layer(model, trainer.accelerator), "fully_shard per layer (FSDP2, as the policy)"
    return model.to(trainer.args.device), "whole on each rank"


def _sharded_per_layer(model, accelerator):
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
