"""Shims that let FSDP run on a machine without an accelerator. Applied there only, never on GPUs.

accelerate (1.15) upgrades the distributed type to FSDP only from GPU-like types: on a CPU-only machine the
launcher's FSDP request ends up as MULTI_CPU and the FSDP plugin is dropped, so "FSDP" silently trains as DDP.
This module re-selects FSDP when the launcher asked for it (see shared/FEASIBILITY.md: weights then equal DDP's).
DeepSpeed needs no patch here: recipes/sft.py passes the DeepSpeed config through TrainingArguments with
use_cpu and starts DeepSpeed's comm layer on gloo (hftrain.engine).
"""

from __future__ import annotations

import os

_applied = False


def fsdp_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def apply_fsdp_on_cpu() -> None:
    """Make AcceleratorState keep the FSDP plugin on a CPU-only multi-process run. Idempotent."""
    global _applied
    if _applied:
        return
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU and (fsdp_plugin is not None or fsdp_requested()):
            self.distributed_type = DistributedType.FSDP
            if fsdp_plugin is not None:
                if self._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(self._mixed_precision)
                self.fsdp_plugin = fsdp_plugin
            # FSDP compares parameter devices with this one: "cpu", not "cpu:0".
            self.device = torch.device("cpu")
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            PartialState._shared_state["device"] = torch.device("cpu")

    AcceleratorState.__init__ = __init__
    _applied = True
