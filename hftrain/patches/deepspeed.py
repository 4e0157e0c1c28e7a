"""Changes to DeepSpeed (written against 0.19.8): two bugs of its ZeRO-3 optimizer that change numbers or memory.

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
