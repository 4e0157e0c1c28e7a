"""LoRA through peft: the config of model.lora (model.py puts it on the model, export merges it away)."""

from __future__ import annotations

from ..config import ModelSection
from ..heads import Head


def lora_config(cfg: ModelSection, head: Head = Head.CAUSAL_LM):
    """peft's LoraConfig of model.lora on a model with `head` (its peft task type). peft's "all-linear" leaves a
    sequence classifier's head out (trained whole, modules_to_save) but not a token classifier's, whose head would
    get LoRA and modules_to_save at once (peft raises): it is left out by name (peft's classifier head names)."""
    from peft import LoraConfig  # optional dependency, heavy to import: LoRA runs only

    head_out = head is Head.TOKEN_CLASSIFICATION and cfg.lora.target_modules == "all-linear"
    return LoraConfig(task_type=head.peft_task_type, r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                      lora_dropout=cfg.lora.dropout, target_modules=cfg.lora.target_modules,
                      exclude_modules=["classifier", "score"] if head_out else None,
                      modules_to_save=cfg.lora.modules_to_save, target_parameters=cfg.lora.target_parameters)
