"""Loading a quantised base: transformers' BitsAndBytesConfig of the recipe's model.quantization, the device each
rank loads it on, and peft's preparation for training."""

from __future__ import annotations

import importlib.util

import torch

from ..config import ModelSection, QuantizationSection
from ..distributed import local_rank

# The install line named when bitsandbytes is missing (the version the suite is tested with: constraints.txt).
INSTALL = "pip install bitsandbytes"  # or: pip install hftrain[qlora]


def bitsandbytes_problem() -> str | None:
    """bitsandbytes is an optional dependency: model.quantization only."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"model.quantization needs bitsandbytes, which is not installed here: `{INSTALL}`"
    return None


def compute_dtype(cfg: ModelSection) -> torch.dtype:
    """model.quantization.compute_dtype; auto: model.dtype, float32 where that is auto too (bitsandbytes' own
    default)."""
    name = cfg.quantization.compute_dtype
    if name == "auto":
        name = cfg.dtype if cfg.dtype != "auto" else "float32"
    return getattr(torch, name)


def bnb_config(cfg: ModelSection):
    """transformers' BitsAndBytesConfig of model.quantization (rules.quantization_problems already refused 4-bit
    keys with bits 8)."""
    from transformers import BitsAndBytesConfig

    q: QuantizationSection = cfg.quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.type or "nf4",
                              bnb_4bit_use_double_quant=True if q.double_quant is None else q.double_quant,
                              bnb_4bit_compute_dtype=compute_dtype(cfg),
                              bnb_4bit_quant_storage=getattr(torch, q.storage_dtype or "uint8"))


def placement() -> dict:
    """Where a quantised model is put at load time (from_pretrained's keywords): whole on each rank's own device
    (accelerate refuses to train one that lies elsewhere), the rank's GPU (LOCAL_RANK, as the launcher exported it)
    or the CPU; under ZeRO-3 none (transformers refuses a device_map there, and puts the model on this process's
    current device itself: whole, since it enters no zero.Init for a quantised model; DeepSpeed partitions it later)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return {}
    return {"device_map": {"": local_rank()} if torch.cuda.is_available() else {"": "cpu"}}


def keep_training_kernels(model):
    """Every 4-bit layer of `model` computes with the kernel it trains with, in eval and generation too.

    Why by hand: on a CPU with AVX512-BF16, bitsandbytes 0.50's Linear4bit repacks its weight in place, the first
    time it runs in eval mode without gradients (an eval, a GRPO generation), for a bf16 inference kernel. It never
    packs it back, so every later training forward takes that kernel, which has no backward: the gradient through the
    quantised layers is silently dropped (the LoRA adapters below them stop learning). The repacking also crashes
    on layers narrower than 64 inputs or with outputs not a multiple of 32. Nothing in bitsandbytes or peft turns it
    off but this flag, read by each layer's forward."""
    import bitsandbytes as bnb  # optional dependency: model.quantization only

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def prepare_for_training(model):
    """peft's preparation of a quantised base: its other weights (norms, embeddings, head) in float32 for stable
    training. Gradient checkpointing stays the recipe's (model.gradient_checkpointing, switched on with the
    adapter's input gradients as for LoRA on a full-precision base): peft's default would switch it on."""
    from peft import prepare_model_for_kbit_training  # optional dependency, heavy to import

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
