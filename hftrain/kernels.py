"""`model.kernels`: the model's layers only. Fused GPU kernels from liger-kernel: its RMSNorm, RoPE and SwiGLU put
into the model by liger's own per-family function, on the model instance. The loss is training.loss_impl's, never this
key's: liger's own cross-entropy patches are left off (they return a mean over the micro-batch's tokens, or no logits,
and would bypass the loss's normalisation over the global batch); its fused linear cross-entropy runs only where
training.loss_impl: fused asks for it (losses/fused_ce.py), refused with `none`. Triton kernels: CUDA only.

`model.kernels` unset is the fastest exact path here (issue 42): liger where it can run (CUDA, liger-kernel
installed, a family it has kernels for, a base that is not quantised), else the model's own layers; `liger` asks for
them and is refused where they cannot run; `none` keeps the model's own layers. The run and `hftrain plan` say which
path was taken (kernels_line)."""

from __future__ import annotations

import importlib.util

import torch

INSTALL = "pip install liger-kernel"
LIGER_LAYERS = "liger's RMSNorm, RoPE and SwiGLU"


def liger_unavailable(model_type: str | None) -> tuple[str, str] | None:
    """(why liger's kernels cannot run here on a model of `model_type`, in a few words; the problem with its fix when
    `model.kernels: liger` asked for them), or None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return ("liger-kernel is not installed here",
                f"model.kernels: liger needs liger-kernel, which is not installed here: `{INSTALL}`")
    if not torch.cuda.is_available():
        why = "liger's kernels are Triton kernels for CUDA GPUs, and this machine has none"
        return why, f"model.kernels: {why}; remove model.kernels here (the model's own layers run instead)"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        why = f"liger has no kernels for model type {model_type!r}"
        families = ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))
        return why, f"model.kernels: {why} (it has: {families}); remove it"
    return None


def liger_problem(model_type: str | None) -> str | None:
    """Why `model.kernels: liger` cannot run here on a model of `model_type`, with the fix, or None."""
    why = liger_unavailable(model_type)
    return None if why is None else why[1]


def _not_by_default(model_type: str | None, quantized: bool) -> str | None:
    """Why model.kernels unset does not take liger's kernels here, or None."""
    if quantized:  # liger over bitsandbytes' layers is not measured: asked for, it is tried; never by default
        return "not by default over a quantised base (model.kernels: liger asks for it)"
    why = liger_unavailable(model_type)
    return None if why is None else why[0]


def uses_liger(kernels: str | None, model_type: str | None, quantized: bool = False) -> bool:
    """Whether a model of `model_type` gets liger's kernels for model.kernels as set (None: where they can run)."""
    if kernels is None:
        return _not_by_default(model_type, quantized) is None
    return kernels == "liger"


def kernels_line(kernels: str | None, model_type: str | None, quantized: bool = False) -> str:
    """One line saying which layers a run of `model_type` takes, and why."""
    if kernels == "none":
        return "kernels: the model's own layers (model.kernels: none)"
    if kernels == "liger":
        unavailable = liger_unavailable(model_type)
        if unavailable is not None:  # check and the run refuse it: the plan must not promise it
            return f"kernels: none can run as asked: {unavailable[1]} (hftrain check refuses it)"
        return f"kernels: {LIGER_LAYERS} (model.kernels: liger)"
    why = _not_by_default(model_type, quantized)
    if why is None:
        return f"kernels: {LIGER_LAYERS} (model.kernels unset: the fastest exact path here; `none` turns them off)"
    return f"kernels: the model's own layers (model.kernels unset; liger: {why})"


def apply_liger(model) -> None:
    """liger's kernels into `model` (liger_problem was None for it)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # liger's entry point for an instance

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
