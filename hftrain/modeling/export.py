"""What a save writes: the weights' shapes in the Hub's layout, and base + LoRA merged into a plain model."""

from __future__ import annotations

import contextlib
import os

from ..config import ModelSection
from ..quantization import checked_merged_model
from .model import load_base


def saved_shapes(model) -> dict[str, tuple[int, ...]]:
    """name -> shape of `model`'s weights as save_pretrained writes them (works on the meta device): transformers 5
    holds some families' experts fused (Mixtral's, Qwen-MoE's) and saves them per expert, in the Hub's layout."""
    from transformers.core_model_loading import revert_weight_conversion  # the one place saving's names come from

    return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(model.state_dict())).items()}


def without_tied_copies(state_dict: dict, model) -> dict:
    """A gathered state dict (FSDP2's full one) without the copies of tied weights. Gathered, a tied weight (the
    lm_head.weight of a model whose config ties it to the embedding) is a tensor of its own, and save_pretrained, which
    finds ties by shared storage, would write it beside its source where a one-process save writes the source alone.
    A target is dropped only where the model declares the tie and both tensors are equal."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    drop = {target for target, source in tied.items() if target in state_dict and source in state_dict
            and state_dict[target].shape == state_dict[source].shape
            and bool((state_dict[target] == state_dict[source]).all())}
    return {k: v for k, v in state_dict.items() if k not in drop}


def _whole(model, output_dir: str, cfg: ModelSection, sharded: bool):
    """The QLoRA model to merge, whole on this process: `model` itself, or where FSDP or ZeRO-3 shards it (each rank
    holds a piece of every weight) the base quantised again from its files with the adapter output_dir holds, as
    saved; the merge checks that base against the one the run recorded (quantization.checked_merged_model)."""
    if not sharded:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(cfg, quantized=True), output_dir)


@contextlib.contextmanager
def loading_outside_zero3(args):
    """Models loaded in this block load whole on this process: a ZeRO-3 run's config (`args`, its TrainingArguments)
    makes from_pretrained partition them with zero.Init, a collective that only the main process would reach (the
    merge: a hang); it is registered again after."""
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if getattr(args, "hf_deepspeed_config", None) is not None:
            set_hf_deepspeed_config(args.hf_deepspeed_config)


def save_merged(model, tokenizer, output_dir: str, cfg: ModelSection, sharded: bool = False) -> str:
    """base + LoRA merged into a plain model in output_dir/merged (safetensors). A quantised base is dequantised
    first, into a full-precision copy of the base in model.dtype (quantization.merge says why), once shown to be the
    packed base the run trained against (its fingerprint, written to output_dir); `sharded`: the run's
    strategy shards the weights (FSDP, ZeRO-3)."""
    if cfg.quantization is not None:
        merged = checked_merged_model(model, _whole(model, output_dir, cfg, sharded),
                                      load_base(cfg, quantized=False), output_dir)
    else:
        merged = model.merge_and_unload()
    path = os.path.join(output_dir, "merged")
    merged.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
