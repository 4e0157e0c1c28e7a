"""Guards of a run's integrity: finite-or-stop for every optimizer step, no non-finite weights saved, and the engine
the Trainer built is the strategy the recipe asked for.

- `StepGuard`: the training loss of each micro-batch is kept on the device; once per optimizer step, after the
  gradient norm is known and before the optimizer applies the update, every rank's (loss, grad norm) is gathered
  (one tiny collective, so every rank decides alike and none is left waiting). A non-finite value skips the step
  (up to `training.max_bad_steps`) or stops the run with a `NonFiniteError` naming the step, the value and the fixes.
  Under DeepSpeed, whose engine steps inside backward, the losses are judged before the step's last backward and
  the gradient norm only after the engine's step (trainer/step_guard.py decides where each check runs).
- `check_finite_weights`: one pass over the parameters (each rank its own shards), the verdict all-gathered; a
  non-finite parameter refuses the save, naming it.
- `engine_problem` / `environment_engine_problem`: the engine actually built against the recipe's strategy, after the
  wrap and, where the environment already tells, before anything loads.
"""

from __future__ import annotations

import math
import os
import sys

import torch
from torch.distributed.fsdp import FSDPModule

from . import distributed
from .constants import ZERO_STAGE
from .errors import LaunchError, NonFiniteError

# accelerate's own truthy spellings of a flag variable (accelerate.utils.environment.str_to_bool)
_TRUE = ("y", "yes", "t", "true", "on", "1")


class StepGuard:
    """Finite-or-stop for one optimizer step at a time (see the module's docstring): `add_loss` per micro-batch,
    `verdict` once per step on every rank, `decide` skips (counted in `bad_steps`) or raises."""

    def __init__(self, max_bad_steps: int = 0):
        self.max_bad_steps = max_bad_steps
        self.bad_steps = 0
        self._loss: torch.Tensor | None = None  # this rank's loss summed over the step's micro-batches (on device)

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float().sum()
        self._loss = loss if self._loss is None else self._loss + loss

    def verdict(self, grad_norm, device, *, check_grad_norm: bool = True) -> list[tuple[str, float]]:
        """[(what, value)] of this step's non-finite values over all ranks ([] when all is finite); every rank
        gets the same answer. Call once per optimizer step on every rank."""
        loss = float(self._loss) if self._loss is not None else 0.0
        self._loss = None
        norm = _as_float(grad_norm) if check_grad_norm else 0.0
        local = torch.tensor([loss, norm], dtype=torch.float64, device=device)
        if distributed.world_size() > 1:
            out = [torch.empty_like(local) for _ in range(distributed.world_size())]
            torch.distributed.all_gather(out, local)
        else:
            out = [local]
        bad = [(f"the training loss on rank {r}", v[0].item()) for r, v in enumerate(out) if not math.isfinite(v[0])]
        norms = [v[1].item() for v in out if not math.isfinite(v[1])]
        if norms:
            bad.append(("the gradient norm", norms[0]))
        return bad

    def decide(self, bad: list[tuple[str, float]], step: int, args, can_skip: bool, applied: bool = False) -> bool:
        """True: skip this step (counted). Raises NonFiniteError when no skip is left, or none is possible
        (`can_skip` false); `applied`: the engine has already applied this step's update (DeepSpeed's grad norm)."""
        if not bad:
            return False
        if can_skip and self.bad_steps < self.max_bad_steps:
            self.bad_steps += 1
            distributed.print0(f"hftrain: warning: optimizer step {step}: {_values(bad)}; the step is skipped (bad "
                               f"step {self.bad_steps} of at most {self.max_bad_steps}, training.max_bad_steps)",
                               file=sys.stderr)
            return True
        raise NonFiniteError(stop_message(bad, step, args, self.bad_steps, self.max_bad_steps, can_skip, applied))


def _as_float(value) -> float:
    if value is None:
        return 0.0
    if hasattr(value, "full_tensor"):  # a DTensor norm (FSDP2)
        value = value.full_tensor()
    return float(value)


def _values(bad: list[tuple[str, float]]) -> str:
    return ", ".join(f"{what} is {value}" for what, value in bad)


def stop_message(bad, step: int, args, skipped: int, max_bad: int, can_skip: bool, applied: bool = False) -> str:
    when = ("DeepSpeed's engine had already applied the update inside backward; nothing is saved from it" if applied
            else "the update was not applied")
    earlier = f" ({skipped} earlier bad step{'s' if skipped != 1 else ''} skipped)" if skipped else ""
    fixes = [f"lower training.learning_rate (now {args.learning_rate:g})",
             (f"clip gradients harder with a lower training.max_grad_norm (now {args.max_grad_norm:g})"
              if args.max_grad_norm > 0 else "enable gradient clipping with training.max_grad_norm (now 0: off)"),
             f"check the data of optimizer step {step}"]
    if can_skip:
        fixes.append(f"let such steps be skipped with training.max_bad_steps (now {max_bad})")
    return (f"optimizer step {step}: {_values(bad)}; the run stops, {when}{earlier}. Fixes: "
            + "; ".join(fixes))


# -- weights -------------------------------------------------------------------------------------------------------
def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard (FSDP2), a ZeRO-3 partition, else the tensor."""
    if hasattr(p, "ds_tensor"):  # ZeRO-3: p.data is an empty placeholder outside a gather
        return p.ds_tensor
    if hasattr(p, "to_local"):
        return p.to_local()
    return p


@torch.no_grad()
def nonfinite_parameters(model) -> list[str]:
    """Names of this rank's parameters (its shards) that hold a NaN or an infinity: one pass over the weights."""
    named = [(n, _local(p)) for n, p in model.named_parameters()]
    named = [(n, t) for n, t in named if t.numel() and t.is_floating_point()]
    if not named:
        return []
    flags = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()
    return [n for (n, _), ok in zip(named, flags.tolist()) if not ok]


def check_finite_weights(model, what: str) -> None:
    """Raise NonFiniteError naming the first non-finite parameter of any rank; every rank must call it (it
    all-gathers the verdict, so every rank raises alike)."""
    local = nonfinite_parameters(model)
    found = [(r, names) for r, names in enumerate(distributed.all_gather_object(local)) if names]
    if found:
        rank, names = found[0]
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        where = f" (rank {rank}'s shard)" if distributed.world_size() > 1 else ""
        raise NonFiniteError(
            f"refusing to save {what}: parameter {names[0]}{more}{where} holds NaN or infinite values. Training "
            "diverged; lower training.learning_rate or enable training.max_grad_norm, and resume from the last "
            "checkpoint written before it")


# -- the engine ----------------------------------------------------------------------------------------------------
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
    else:
        out["engine"] = "single"  # no wrapper: one process (ddp on a world of 1 builds none)
    return out


def engine_problem(strategy: str, built: dict, world_size: int) -> str | None:
    """Why the engine built is not `strategy` (None when it is): ddp = DDP (or no wrapper on one process), fsdp =
    FSDP2 modules, zero* = a DeepSpeed engine with that stage and those offload devices."""
    engine = built["engine"]
    if engine == strategy or (strategy == "ddp" and engine == "single" and world_size == 1):
        return None
    if built["zero_stage"] is not None:
        detail = (f"DeepSpeed ZeRO stage {built['zero_stage']} (optimizer offload {built['offload_optimizer']}, "
                  f"parameter offload {built['offload_param']})")
    else:
        detail = {"ddp": "plain DDP", "fsdp": "FSDP2", "single": "no distributed wrapper"}[engine]
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
