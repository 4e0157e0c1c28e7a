"""`training.loss_impl: fused`: the training loss's sum over the target tokens from liger-kernel's fused linear
cross-entropy, whose Triton kernels project the hidden states through the head block by block and compute each block's
CE and gradients in the same pass. Written here only as the dispatch and its rules: the kernel is Liger's.

Opt-in, never chosen by `auto`: it has not yet been measured exact and faster than chunked_ce on a GPU here
(bench/gpu.py measures it, asked for by this key). Like chunked_ce, only the rows with a target are projected: they are
selected before the kernel is called, so prompts and padding cost nothing. Asked for where it does not compute what
chunked_ce computes, it is refused (by `hftrain check` and the run alike, `problem`), never replaced in silence: it
needs the token average (every target weighs 1, so the sum Liger returns with reduction "sum" is chunked_ce's;
losses.normalise then divides by the global batch's targets), a head whose logits are at most soft-capped (Gemma's;
Liger has no scale or divisor), a CUDA GPU and liger-kernel installed. The eval loss (no gradients) stays chunked_ce's.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..constants import IGNORE_INDEX
from .chunked_ce import HeadMath, head_of

INSTALL = "pip install liger-kernel"
FIX = "set training.loss_impl: chunked (hftrain's own chunks, the same loss) or auto"


@functools.cache  # one look along sys.path per process
def installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def machine_problem(device_type: str) -> str | None:
    """Why liger's fused kernel cannot run on a `device_type` device of this machine, or None."""
    if not installed():
        return f"it needs liger-kernel, which is not installed here (`{INSTALL}`)"
    if device_type != "cuda":
        return "liger's fused kernel is a Triton kernel for CUDA GPUs, and this run has none"
    return None


def head_problem(math: HeadMath) -> str | None:
    """Why liger's kernel does not compute this head's logits (Cohere's scale, Granite's divisor), or None."""
    if math.scale is not None:
        return f"the model multiplies its logits by a logit scale ({math.scale}), which liger's kernel has not"
    if math.divide is not None:
        return f"the model divides its logits by logits_scaling ({math.divide}), which liger's kernel has not"
    return None


def refusal(why: str) -> str:
    return f"training.loss_impl: fused cannot run here: {why}; {FIX}"


def where_problem(model, device_type: str) -> str | None:
    """`training.loss_impl: fused: <why it cannot run on this machine for this model; the fix>`, or None (`hftrain
    check` asks it of the model built on the meta device, the run of the loaded one)."""
    why = machine_problem(device_type)
    if why is None:
        _, math, why = head_of(model)
        why = why or head_problem(math)
    return None if why is None else refusal(why)


def problem(model, device_type: str, loss_averaging: str) -> str | None:
    """where_problem, and the sequence average it does not compute (config.rules refuses that of a recipe)."""
    if loss_averaging != "token":
        return ("training.loss_impl: fused sums the token CE, every target weighing 1, and cannot compute "
                f"training.loss_averaging: {loss_averaging}; {FIX}")
    return where_problem(model, device_type)


def linear_ce_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  math: HeadMath, label_smoothing: float) -> torch.Tensor:
    """sum over the rows with a target of CE(softcap(hidden @ weight.T + bias), target): hidden (N, H), targets (N,).
    Only the rows with a target reach the kernel (prompts and padding are never projected)."""
    keep = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    if keep.numel() == 0:  # a micro-batch of prompts only: 0, with the zero gradients chunked_ce gives too
        return sum(x.sum() * 0.0 for x in (hidden, weight, bias) if x is not None).float()
    hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    loss = _liger_loss(label_smoothing, math.softcap)(weight, hidden, targets, bias)
    return loss[0] if isinstance(loss, tuple) else getattr(loss, "loss", loss)  # versions return a tuple or an output


def _liger_loss(label_smoothing: float, softcap: float | None):
    # liger-kernel is optional (the `liger` extra) and needs a GPU: imported only where it runs.
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing,
                                            reduction="sum", softcap=softcap)
