"""The parts of an image-text-to-text model beside its language model, by family, as module paths: what model.freeze
freezes (vision.freezing) and what LoRA leaves out unless model.lora.vision_parts names it (lora.lora_config). Named as
LLaMA-Factory's freeze_vision_tower / freeze_multi_modal_projector (ms-swift: freeze_vit / freeze_aligner) name them:

- `vision_tower`: the image encoder (Qwen2.5-VL: model.visual without its merger; LLaVA: model.vision_tower);
- `projector`: what maps image features into the language model (Qwen2.5-VL: model.visual.merger, the patch merger;
  LLaVA: model.multi_modal_projector)."""

from __future__ import annotations

import re

LANGUAGE_MODEL = "language_model"  # the part that is all the rest (model.freeze names it; LoRA always adapts it)

# family (config.json's model_type) -> part -> (module path in the model, module paths inside it left out of the part)
PARTS = {
    "qwen2_5_vl": {"vision_tower": ("model.visual", ("model.visual.merger",)),
                   "projector": ("model.visual.merger", ())},
    "qwen2_vl": {"vision_tower": ("model.visual", ("model.visual.merger",)),
                 "projector": ("model.visual.merger", ())},
    # Qwen3-VL's projector is its merger and the deepstack mergers (features of inner blocks to inner layers of the
    # language model): model.visual without the tower's own modules
    "qwen3_vl": {"vision_tower": ("model.visual", ("model.visual.merger", "model.visual.deepstack_merger_list")),
                 "projector": ("model.visual", ("model.visual.patch_embed", "model.visual.pos_embed",
                                                "model.visual.rotary_pos_emb", "model.visual.blocks"))},
    "llava": {"vision_tower": ("model.vision_tower", ()), "projector": ("model.multi_modal_projector", ())},
    # LLaVA-NeXT's image_newline (one vector of the language model's width, between rows of tiles) is a parameter
    # of the model itself, not of a part: it trains with the language model
    "llava_next": {"vision_tower": ("model.vision_tower", ()), "projector": ("model.multi_modal_projector", ())},
    "gemma3": {"vision_tower": ("model.vision_tower", ()), "projector": ("model.multi_modal_projector", ())},
    "idefics3": {"vision_tower": ("model.vision_model", ()), "projector": ("model.connector", ())},
}
PARTS["qwen3_vl_moe"] = PARTS["qwen3_vl"]  # Qwen3-VL's tower and mergers; its language model holds the experts

# parts without a linear layer, so without anything for LoRA to adapt (model.lora.vision_parts refuses them)
WITHOUT_LINEAR = {("gemma3", "projector"): "Gemma 3's projector is a projection matrix and a norm, no linear layer"}


def _part_pattern(path: str, left_out: tuple[str, ...]) -> str:
    """A regex that fully matches the module names inside `path` but not inside any of `left_out` (paths in it)."""
    outside = "".join(rf"(?!{re.escape(inner[len(path) + 1:])}(\.|$))" for inner in left_out)
    return rf"{re.escape(path)}\.{outside}.*"


def lora_exclusion(model_type: str, adapted: list[str]) -> str | None:
    """peft's exclude_modules (a regex it fully matches against each module name) that keeps LoRA off the parts of a
    `model_type` model not in `adapted` (model.lora.vision_parts): by default the language model alone is adapted,
    whatever target_modules names ("all-linear" reaches every linear layer of the vision tower and projector too,
    and a name list such as [q_proj, v_proj] reaches LLaVA's CLIP attention). None: every part is adapted."""
    left = [_part_pattern(*where) for part, where in PARTS[model_type].items() if part not in adapted]
    return "|".join(f"(?:{p})" for p in left) or None
