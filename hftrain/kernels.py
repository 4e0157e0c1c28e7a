"""Fused GPU kernels from liger-kernel (`model.kernels: liger`): its RMSNorm, RoPE and SwiGLU put into the model by
liger's own per-family function, on the model instance. hftrain's loss is kept: liger's cross-entropy and fused
linear cross-entropy are left off, since they return a mean over the micro-batch's tokens (or no logits) and would
bypass the loss's normalisation over the global batch (losses/global_batch.py). Triton kernels: CUDA only."""

from __future__ import annotations

import importlib.util

import torch

INSTALL = "pip install liger-kernel"


def liger_problem(model_type: str | None) -> str | None:
    """Why liger's kernels cannot run here on a model of `model_type`, or None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"model.kernels: liger needs liger-kernel, which is not installed here: `{INSTALL}`"
    if not torch.cuda.is_available():
        return ("model.kernels: liger's kernels are Triton kernels for CUDA GPUs, and this machine has none; remove "
                "model.kernels here (the model's own layers run instead)")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        families = ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))
        return f"model.kernels: liger has no kernels for model type {model_type!r} (it has: {families}); remove it"
    return None


def apply_liger(model) -> None:
    """liger's kernels into `model` (liger_problem was None for it)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # liger's entry point for an instance

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
