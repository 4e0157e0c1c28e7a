"""On CUDA, the chunked loss's sum over the target tokens from liger-kernel's fused linear cross-entropy: its Triton
kernels project the hidden states through the head block by block and compute each block's CE and gradients in the
same pass, faster than chunked_ce's PyTorch chunks and with no more memory. Written here only as the dispatch: the
kernel is Liger's.

Used where it computes what chunked_ce computes: the token average (every target weighs 1, so the sum Liger returns
with reduction "sum" is chunked_ce's; losses.normalise then divides by the global batch's targets, so 1 rank x GA4
still equals 2 ranks x GA2), a head whose logits are at most soft-capped (Gemma's; Liger has no scale or divisor),
tensors on a GPU and liger-kernel installed. Elsewhere (CPU, sequence averaging, Cohere's scale, Granite's divisor)
chunked_ce runs.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..constants import IGNORE_INDEX
from .chunked_ce import HeadMath


@functools.cache  # asked at every loss step on a GPU: one look along sys.path per process
def installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def usable(device: torch.device, math: HeadMath, mode: str) -> bool:
    """Whether the fused kernel computes this sum: the token average, on a GPU, a head that at most soft-caps."""
    return mode == "token" and device.type == "cuda" and math.scale is None and math.divide is None and installed()


def linear_ce_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  math: HeadMath, label_smoothing: float) -> torch.Tensor:
    """sum over the rows with a target of CE(softcap(hidden @ weight.T + bias), target): hidden (N, H), targets (N,)."""
    loss = _liger_loss(label_smoothing, math.softcap)(weight, hidden, targets, bias)
    return loss[0] if isinstance(loss, tuple) else getattr(loss, "loss", loss)  # versions return a tuple or an output


def _liger_loss(label_smoothing: float, softcap: float | None):
    # liger-kernel is optional (the `liger` extra) and needs a GPU: imported only where it runs.
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing,
                                            reduction="sum", softcap=softcap)
