"""LoRA through peft: the config of model.lora (model.py puts it on the model, export merges it away)."""

from __future__ import annotations

from ..config import ModelSection


def lora_config(cfg: ModelSection):
    """peft's LoraConfig of model.lora."""
    from peft import LoraConfig  # optional dependency, heavy to import: LoRA runs only

    return LoraConfig(task_type="CAUSAL_LM", r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=cfg.lora.target_modules, modules_to_save=cfg.lora.modules_to_save,
                      target_parameters=cfg.lora.target_parameters)
