"""The engine the Trainer built is the strategy the recipe asked for: checked after the wrap and, where the environment
already tells, before anything loads."""

from __future__ import annotations

import os

import torch
from torch.distributed.fsdp import FSDPModule

from ..constants import ZERO_STAGE
from ..errors import LaunchError

# accelerate's own truthy spellings of a flag variable (accelerate.utils.environment.str_to_bool)
_TRUE = ("y", "yes", "t", "true", "on", "1")


def _device(offload) -> str:
    device = getattr(offload, "device", None) or "none"
    return str(getattr(device, "value", device))  # DeepSpeed's OffloadDeviceEnum, or a plain string


def engine_built(trainer) -> dict:
    """What engine the Trainer actually built: {'engine': a strategy name (ddp, fsdp, zero1 ... zero_infinity) or
    'single' (no wrapper), 'wrapper': class name, 'zero_stage', 'offload_optimizer', 'offload_param'}."""
    wrapped = trainer.model_wrapped
    out = {"wrapper": type(wrapped).__name__, "zero_stage": None, "offload_optimizer": None, "offload_param": None}
    if trainer.is_deepspeed_enabled and hasattr(wrapped, "zero_optimization_stage"):
        stage = int(wrapped.zero_optimization_stage())
        opt, param = _device(wrapped.zero_offload_optimizer()), _device(wrapped.zero_offload_param())
        out.update(zero_stage=stage, offload_optimizer=opt, offload_param=param)
        # named as config.strategy_of_deepspeed_config names a DeepSpeed config
        devices = {opt, param}
        out["engine"] = (f"zero{stage}" if stage != 3 else "zero_infinity" if "nvme" in devices
                         else "zero3_offload" if "cpu" in devices else "zero3")
    elif any(isinstance(m, FSDPModule) for m in (trainer.model, wrapped)):
        out["engine"] = "fsdp"
    elif isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        out["engine"] = "ddp"
    elif (getattr(trainer.model, "tp_size", None) or 1) > 1:
        out["engine"] = "tensor_parallel"  # split by transformers at load time (strategy.tp_size): no wrapper
    else:
        out["engine"] = "single"  # no wrapper: one process (ddp on a world of 1 builds none)
    return out


def engine_problem(strategy: str, built: dict, world_size: int) -> str | None:
    """Why the engine built is not `strategy` (None when it is): ddp = DDP (or no wrapper on one process), fsdp =
    FSDP2 modules, zero* = a DeepSpeed engine with that stage and those offload devices."""
    engine = built["engine"]
    if engine == strategy or (strategy == "ddp" and engine == "single" and world_size == 1):
        return None
    if strategy == "ddp" and engine == "tensor_parallel":  # only strategy.tp_size loads a model split so
        return None
    if built["zero_stage"] is not None:
        detail = (f"DeepSpeed ZeRO stage {built['zero_stage']} (optimizer offload {built['offload_optimizer']}, "
                  f"parameter offload {built['offload_param']})")
    else:
        detail = {"ddp": "plain DDP", "fsdp": "FSDP2", "single": "no distributed wrapper",
                  "tensor_parallel": "a tensor-parallel model"}[engine]
    return (f"strategy.name is '{strategy}' but the Trainer built {detail} (model wrapper {built['wrapper']}): "
            f"the run would not train as asked.{_cause(strategy)}")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _cause(strategy: str) -> str:
    if _flag("ACCELERATE_USE_CPU") and strategy != "ddp":
        return (" The cause: ACCELERATE_USE_CPU is set in the environment (or use_cpu: true in your accelerate "
                "config), which makes accelerate drop DeepSpeed and FSDP. Unset it (hftrain puts a GPU-less run on "
                "the CPU itself) and set use_cpu: false in the accelerate config")
    return " Please report this with the launch command and your accelerate config"


def environment_engine_problem(strategy: str, accelerator: bool) -> str | None:
    """What the environment already says before anything loads: ACCELERATE_USE_CPU=true makes accelerate build its
    state for the CPU, dropping a DeepSpeed strategy (accelerate.state: DeepSpeed only `and not cpu`), and FSDP
    unless hftrain's CPU shim (patches.accelerate, applied only without an accelerator) restores it."""
    if not _flag("ACCELERATE_USE_CPU"):
        return None
    if strategy in ZERO_STAGE or (strategy == "fsdp" and accelerator):
        return (f"strategy.name: '{strategy}' cannot run with ACCELERATE_USE_CPU={os.environ['ACCELERATE_USE_CPU']} "
                "in the environment (set by you, or by use_cpu: true in your accelerate config): accelerate would "
                "silently train without it. Unset ACCELERATE_USE_CPU (hftrain puts a GPU-less run on the CPU itself) "
                "and set use_cpu: false in the accelerate config")
    return None


def raise_engine_problem(strategy: str, trainer) -> None:
    problem = engine_problem(strategy, engine_built(trainer), trainer.args.world_size)
    if problem:
        raise LaunchError(problem)
