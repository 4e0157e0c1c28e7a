"""Changes to accelerate (written against 1.15).

1. `apply_fsdp_on_cpu`: without an accelerator, accelerate turns the launcher's FSDP request into MULTI_CPU and drops
   the FSDP plugin, so "FSDP" silently trains as DDP; the patch re-selects FSDP (CPU-only machines only). It can go
   when an FSDP launch on a CPU-only machine reports DistributedType.FSDP by itself.
2. `apply_tensor_parallel_on_cpu`: ParallelismConfig refuses a MULTI_CPU run (its check lists accelerators only), so a
   model transformers split over the ranks at load time (tensor parallelism on gloo) cannot be prepared on a CPU-only
   machine; the patch lets that check see a CPU run as a multi-device one (CPU-only machines only, tensor parallelism
   only). It can go when ParallelismConfig._validate_accelerator accepts DistributedType.MULTI_CPU.
3. `HookedDDPKwargs`: registers hftrain's DDP communication hook where accelerate registers its own (whose types cover
   only fp16, bf16 on NCCL and PowerSGD, unmetered); installed as `accelerator.ddp_handler`, since accelerate maps
   `kwargs_handlers` by exact class. It can go when DistributedDataParallelKwargs accepts any hook callable and state.
"""

from __future__ import annotations

import copy
import os
from dataclasses import fields

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType

_applied = False
_tensor_parallel_applied = False


def fsdp_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def apply_fsdp_on_cpu() -> None:
    """Make AcceleratorState keep the FSDP plugin on a CPU-only multi-process run. Idempotent."""
    global _applied
    if _applied:
        return
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


class _SeenAsMultiDevice:
    """The Accelerator as ParallelismConfig's check reads it, a CPU run counted as multi-device."""

    multi_device = True

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def apply_tensor_parallel_on_cpu() -> None:
    """Let ParallelismConfig accept a tensor-parallel MULTI_CPU run (gloo). Idempotent."""
    global _tensor_parallel_applied
    if _tensor_parallel_applied:
        return
    from accelerate.parallelism_config import ParallelismConfig

    original = ParallelismConfig._validate_accelerator

    def _validate_accelerator(self, accelerator):
        if accelerator.distributed_type == DistributedType.MULTI_CPU and self.tp_enabled:
            accelerator = _SeenAsMultiDevice(accelerator)
        return original(self, accelerator)

    ParallelismConfig._validate_accelerator = _validate_accelerator
    _tensor_parallel_applied = True


class HookedDDPKwargs(DistributedDataParallelKwargs):
    """DDP kwargs (every option of `base` kept) whose register_comm_hook registers `hook` with the state
    `make_state()` returns; `on_register` receives that state (for metering). Constructible without arguments, as
    accelerate's `to_kwargs` compares against a default instance."""

    def __init__(self, base: DistributedDataParallelKwargs | None = None, make_state=None, hook=None,
                 on_register=None):
        super().__init__(**({f.name: getattr(base, f.name) for f in fields(base)} if base is not None else {}))
        self._make_state, self._hook, self._on_register = make_state, hook, on_register

    def to_dict(self):  # DDP's own options only: the hook wiring is not a DistributedDataParallel argument
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    def register_comm_hook(self, model):
        state = self._make_state()
        model.register_comm_hook(state, self._hook)
        self._on_register(state)
