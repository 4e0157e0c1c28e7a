"""`model.lora.vision_parts`: the parts of an image-text-to-text model beside its language model that get LoRA
adapters too (by default none: the language model alone, as LLaMA-Factory with freeze_vision_tower and
freeze_multi_modal_projector, its defaults). The module paths are modeling.model_parts.PARTS; peft leaves the other
parts out (lora.lora_config's exclude_modules). What cannot be honoured is refused by `hftrain check` and the run:
the key on a model that is not a checked image-text-to-text family, a name the family has no part for, a part also in
model.freeze, and a target_modules list (which would choose inside the part by name, maybe nothing)."""

from __future__ import annotations

from ..config import LoraSection
from ..modeling.model_parts import PARTS, WITHOUT_LINEAR
from .families import section_family


def lora_part_problems(section) -> list[tuple[str, str]]:
    """(key, problem) for model.lora.vision_parts of a model section."""
    lora = getattr(section, "lora", None)
    names = lora.vision_parts if isinstance(lora, LoraSection) else None
    if not names or not isinstance(names, list):
        return []
    family, refused = section_family(section, "model.lora.vision_parts", "adapts parts of an image-text-to-text "
                                     "model (projector, vision_tower)")
    if refused:
        return refused
    parts, frozen = PARTS[family], getattr(section, "freeze", None) or []
    out = [(f"model.lora.vision_parts.{i}", f"{name!r} is not a part of a {family} model; its parts: "
            f"{', '.join(sorted(parts))}") for i, name in enumerate(names) if name not in parts]
    out += [(f"model.lora.vision_parts.{i}", f"{WITHOUT_LINEAR[family, name]}: LoRA has nothing to adapt there; "
             "remove it (its weights stay as they are)")
            for i, name in enumerate(names) if (family, name) in WITHOUT_LINEAR]
    out += [(f"model.lora.vision_parts.{i}", f"{name!r} is in model.freeze too: a part is either frozen or adapted; "
             "remove it from one of them") for i, name in enumerate(names) if name in parts and name in frozen]
    if lora.target_modules != "all-linear":
        out.append(("model.lora.vision_parts", "adapts every linear layer of the parts it names, which needs "
                    f"model.lora.target_modules: all-linear (a list, here {lora.target_modules!r}, would choose inside "
                    "them by name, perhaps nothing); remove model.lora.target_modules or model.lora.vision_parts"))
    return out
