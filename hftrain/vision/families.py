"""The vision-language families hftrain has checked (masks against the family's template oracle, the processor's
placeholder expansion token for token: tests/test_vision.py), found from a model's config.json; a model transformers
builds with AutoModelForImageTextToText whose family is not here is refused by name with this list."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from ..heads import Head


@dataclass(frozen=True)
class VisionFamily:
    model_type: str  # config.json's model_type
    processor_class: str  # transformers' processor class of the family
    placeholder: str  # the token the chat template writes for one image (the processor expands it)


CHECKED = {f.model_type: f for f in [
    VisionFamily("qwen2_5_vl", "Qwen2_5_VLProcessor", "<|image_pad|>"),
    VisionFamily("llava", "LlavaProcessor", "<image>"),
]}


def model_type_of(name_or_path: str) -> str | None:
    """config.json's model_type of a local model folder (None: no folder or no config.json here, e.g. a Hub id
    not downloaded, or unreadable: the model's own checks say why)."""
    path = os.path.join(name_or_path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def is_image_text_to_text(model_type: str | None) -> bool:
    """Whether transformers builds this model type with AutoModelForImageTextToText (checked or not)."""
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def family_problem(model_type: str | None) -> str | None:
    """A refusal for an image-text-to-text model of a family hftrain has not checked."""
    if not is_image_text_to_text(model_type) or model_type in CHECKED:
        return None
    return (f"the model is an image-text-to-text model of family {model_type!r}, which hftrain has not checked "
            f"(labels against the family's template, the processor's image token expansion); the families checked: "
            f"{', '.join(sorted(CHECKED))}")


# The strategies an image-text-to-text model is proven exact under (tests/test_vision_exact.py: 2 ranks x GA2, packed
# or not, against 1 rank x GA4 in losses, saved weights and the saved folder's logits, both families). FSDP2 and
# ZeRO-3 needed modeling/wrap_classes_and_renamings.py (LLaVA's wrap classes named one it lacks; ZeRO-3 saved
# doubled key prefixes).
# The others (ZeRO-1/2, ZeRO-3 with offload or NVMe: DeepSpeed's own Adam) and sequence parallelism (image tokens split
# over ranks) have not been run with images: refused until each is proven, rather than accepted and wrong.
PROVEN_STRATEGIES = ("ddp", "fsdp", "zero3")


def strategy_problems(model_type: str | None, strategy: str | None, sequence_parallel: int | None) -> list[tuple]:
    """Refusals, as (key, message), for an image-text-to-text model under a strategy it is not proven under
    (PROVEN_STRATEGIES), or with its sequences split over ranks."""
    if model_type not in CHECKED:
        return []
    out = []
    if strategy is not None and strategy not in PROVEN_STRATEGIES:
        out.append(("strategy.name", f"strategy {strategy!r} is not proven for image-text-to-text models yet (only "
                    f"{', '.join(PROVEN_STRATEGIES)} are, with images of different sizes across ranks and "
                    f"accumulation); use strategy.name: {' or '.join(PROVEN_STRATEGIES)}"))
    if isinstance(sequence_parallel, int) and sequence_parallel > 1:
        out.append(("strategy.sequence_parallel", "sequence parallelism is not proven for image-text-to-text models "
                    "yet (an example's image tokens would be split over ranks); leave strategy.sequence_parallel at 1"))
    return out


def head_of(section) -> Head:
    """The head of a model section's model: image-text-to-text for a family hftrain has checked, else a causal LM
    (an image-text-to-text model of another family is refused by the preflight check: family_problem)."""
    name = getattr(section, "name_or_path", None)
    return Head.IMAGE_TEXT_TO_TEXT if isinstance(name, str) and model_type_of(name) in CHECKED else Head.CAUSAL_LM


def processor_class(model_type: str) -> type:
    return getattr(transformers, CHECKED[model_type].processor_class)
