"""`model.freeze`: parts of an image-text-to-text model left untrained, named as LLaMA-Factory's
freeze_vision_tower / freeze_multi_modal_projector (ms-swift: freeze_vit / freeze_aligner) name them: `vision_tower`
and `projector`, each family's module paths in modeling.model_parts.PARTS.

A frozen part's parameters (LoRA adapters inside it included) get requires_grad false after the model loads, so the
optimizer never sees them. A name the family has no part for, or the key on a model that is not image-text-to-text,
is refused by `hftrain check` and the run (freeze_problems); nothing is frozen silently by another name."""

from __future__ import annotations

import sys

from ..distributed import print0
from ..modeling.model_parts import LANGUAGE_MODEL, PARTS
from .families import model_type_of, section_family


def freeze_problems(section) -> list[tuple[str, str]]:
    """(key, problem) for model.freeze: names not a part of the model's family, or a model without parts."""
    names = getattr(section, "freeze", None) or []
    if not names:
        return []
    family, refused = section_family(section, "model.freeze", "freezes parts of an image-text-to-text model "
                                     "(vision_tower, projector)")
    if refused:
        return refused
    parts = part_names(family)
    out = [(f"model.freeze.{i}", f"{name!r} is not a part of a {family} model; its parts: {', '.join(parts)}")
           for i, name in enumerate(names) if name not in parts]
    if not out and set(parts) <= set(names):
        out.append(("model.freeze", f"freezes every part ({', '.join(parts)}): nothing would train; leave one out"))
    return out


def part_names(family: str) -> list[str]:
    """The parts of a `family` model model.freeze names: its vision parts (PARTS) and the language model."""
    return sorted([*PARTS[family], LANGUAGE_MODEL])


def unwrapped(model):
    """The transformers model under a peft wrapper (its module paths are the family's own)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def part_of_parameters(model, family: str) -> dict[str, str]:
    """Each parameter's part (by its name in `model`): a vision part of PARTS, or the language model, which is all
    the rest (its decoder, embeddings and head; LLaVA-NeXT's image_newline; LoRA adapters inside it)."""
    base, owner = unwrapped(model), {}
    for name, (path, left_out) in PARTS[family].items():
        skipped = {id(p) for inner in left_out for p in base.get_submodule(inner).parameters()}
        owner |= {id(p): name for p in base.get_submodule(path).parameters() if id(p) not in skipped}
    return {n: owner.get(id(p), LANGUAGE_MODEL) for n, p in model.named_parameters()}


def frozen_parameters(model, family: str, names: list[str]) -> list[str]:
    """Names (in `model`) of the parameters of the parts `names` of a `family` model."""
    return sorted(n for n, part in part_of_parameters(model, family).items() if part in names)


def freeze_parts(model, family: str, names: list[str]) -> list[str]:
    """Freeze the parts `names` (model.freeze) of a `family` model; the parameters frozen, by name."""
    frozen = frozen_parameters(model, family, names)
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen


def freeze_section_parts(model, section) -> None:
    """model.freeze of a loaded model (its names checked by freeze_problems before the run), said once."""
    if getattr(section, "freeze", None):
        frozen = freeze_parts(model, model_type_of(section.name_or_path), section.freeze)
        print0(f"hftrain: model.freeze: {', '.join(section.freeze)} frozen ({len(frozen)} parameter tensors, "
               f"{sum(p.numel() for n, p in model.named_parameters() if n in set(frozen))} weights)", file=sys.stderr)
