"""LoRA through peft: the config of model.lora (model.py puts it on the model, export merges it away)."""

from __future__ import annotations

from ..config import ModelSection
from ..errors import ModelError
from ..heads import Head
from .model_parts import PARTS, lora_exclusion
from .paths import local_config


def lora_config(cfg: ModelSection, head: Head = Head.CAUSAL_LM):
    """peft's LoraConfig of model.lora on a model with `head` (its peft task type). peft's "all-linear" leaves a
    sequence classifier's head out (trained whole, modules_to_save) but not a token classifier's, whose head would
    get LoRA and modules_to_save at once (peft raises): it is left out by name (peft's classifier head names). An
    image-text-to-text model's vision tower and projector are left out unless model.lora.vision_parts names them."""
    from peft import LoraConfig  # optional dependency, heavy to import: LoRA runs only

    head_out = head is Head.TOKEN_CLASSIFICATION and cfg.lora.target_modules == "all-linear"
    exclude = ["classifier", "score"] if head_out else None
    if head is Head.IMAGE_TEXT_TO_TEXT:
        exclude = lora_exclusion(_family(cfg), cfg.lora.vision_parts)
    return LoraConfig(task_type=head.peft_task_type, r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                      lora_dropout=cfg.lora.dropout, target_modules=cfg.lora.target_modules, exclude_modules=exclude,
                      modules_to_save=cfg.lora.modules_to_save, target_parameters=cfg.lora.target_parameters)


def unmatched_target_parameters(model, targets: list[str] | None) -> list[str]:
    """model.lora.target_parameters entries that name no parameter of `model` (peft matches a parameter's full name
    or its dotted suffix, and ignores an entry that matches nothing as long as another matches: the Hub's per-expert
    names `experts.gate_proj` on a family whose experts hold `gate_up_proj` fused adapted only `down_proj`)."""
    names = [n for n, _ in model.named_parameters()]
    return [t for t in targets or [] if not any(n == t or n.endswith("." + t) for n in names)]


def _family(cfg: ModelSection) -> str:
    """The family of an image-text-to-text model (its parts: model_parts.PARTS); the head is only chosen for a local
    model of a family hftrain has checked (vision.families.head_of), so it is there."""
    config = local_config(cfg)
    model_type = getattr(config, "model_type", None)
    if model_type not in PARTS:
        raise ModelError(f"model.name_or_path: {cfg.name_or_path} is not an image-text-to-text model of a family "
                         f"whose parts hftrain knows ({', '.join(sorted(PARTS))}); LoRA cannot leave its vision out")
    return model_type
