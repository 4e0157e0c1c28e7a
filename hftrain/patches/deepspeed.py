"""Changes to DeepSpeed (written against 0.19.8): bugs of its ZeRO optimizers that change numbers or memory.

Each wraps one method around the faulty line and is idempotent; no release offers the fix. Each can go when a
DeepSpeed release fixes it: the test named in its docstring then passes without it.
"""

from __future__ import annotations

import torch


def _patch_once(cls, name: str, make):
    original = getattr(cls, name)
    if getattr(original, "hftrain_fix", False):
        return
    fixed = make(original)
    fixed.hftrain_fix = True
    setattr(cls, name, fixed)


def share_fp32_master_with_fp32_weights() -> None:
    """ZeRO-3 keeps a second fp32 copy of each partition (4 bytes per parameter / N) even when the weights are fp32:
    the branch meant to reuse them compares a `torch.device` with `self.device`, a string, and
    `torch.device("cpu") == "cpu"` is False (stage3.py, _create_fp32_partitions). Making `self.device` a torch.device
    lets that branch run (offloaded optimizers take another). Tested by tests/test_strategies.py."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # optional dependency

    def make(create):
        def create_fp32_partitions(self):
            if not self.offload_optimizer and isinstance(self.device, str):
                self.device = torch.device(self.device)
            return create(self)
        return create_fp32_partitions

    _patch_once(Stage3, "_create_fp32_partitions", make)


def untie_zero3_universal_steps() -> None:
    """ZeRO-3's universal-checkpoint load gives every sub-group's optimizer state the *same* `step` tensor
    (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3), which Adam increments in place once per
    sub-group, so a resumed run drifts from the uninterrupted one; each sub-group gets its own copy. Tested by
    tests/test_resume.py (ZeRO checkpoints on another world size)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # optional dependency

    def make(load):
        def load_untied(self, checkpoint_dir):
            load(self, checkpoint_dir)
            for flat in self.fp32_partitioned_groups_flat:
                state = self.optimizer.state.get(flat, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        return load_untied

    _patch_once(Stage3, "load_hp_checkpoint_state_from_checkpoint_dir_stage3", make)


def average_gradients_over_sequence_ranks() -> None:
    """Under Ulysses sequence parallelism every ZeRO stage averages gradients over every rank, sequence ranks too.

    What DeepSpeed does: the gradient of each rank (its slice of each sequence) is summed over all ranks and divided
    by the data-parallel size (world / sp) in ZeRO-1/2 (stage_1_and_2.py: gradient_reduction_w_predivide,
    average_tensor, allreduce_bucket) and in ZeRO-3 without reduce_scatter, but by the world size in ZeRO-3's
    default reduce-scatter (stage3.py: __avg_scatter_grads). The loss accelerate and transformers document for
    Ulysses (a differentiable all-gather of the slices' losses: every rank backpropagates the whole loss) is right
    under the latter and makes ZeRO-1/2's gradients exactly sp times too large (2x at sp=2): unseen with Adam, but
    clipping and any non-scale-invariant optimizer step differ. hftrain's loss (each slice's share, normalised for
    an average over every rank: losses.normalise) needs the world too.

    The fix: the optimizer's `sequence_parallel_size`, read only by those divisions (and by ZeRO-1/2's
    allreduce_bucket to reduce in fp32, which the engine already asks for under sequence parallelism:
    seq_parallel_communication_data_type), is set to 1 once the optimizer is built, so every path divides by the
    world size as ZeRO-3's reduce-scatter does. It can go when a DeepSpeed release averages ZeRO-1/2 gradients over
    the world under sequence parallelism: tests/test_sequence_parallel.py's negative control (tests/sp_unpatched.py,
    ZeRO-2 without this patch, gradients 2x the reference) then fails."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # optional dependency
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Stage12

    def make(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.sequence_parallel_size = 1
        return __init__

    for cls in (Stage12, Stage3):
        _patch_once(cls, "__init__", make)
