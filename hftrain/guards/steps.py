"""Finite or stop, every optimizer step: every rank's (loss, grad norm) gathered once per step (one tiny collective,
so every rank decides alike); a non-finite value skips the step (up to training.max_bad_steps) or stops the run with
a NonFiniteError naming the step, the value and the fixes."""

from __future__ import annotations

import math
import sys

import torch

from .. import distributed
from ..errors import NonFiniteError


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
