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
    # the token the image's features take the place of, where it is not the placeholder (Gemma 3 writes
    # <start_of_image> and the processor expands it to <start_of_image>, N x <image_soft_token>, <end_of_image>)
    image_token: str | None = None
    # the batch key of the model's image-token types (1 at image tokens): Qwen-VL's mrope reads mm_token_type_ids,
    # Gemma 3's bidirectional attention over an image's tokens token_type_ids; None: the model reads none
    token_types: str | None = None
    # why packed rows are refused for the family; None: packing is exact (tests/test_vision_packing.py)
    packing_refused: str | None = None
    # how the family sizes an image, where its image processor takes no pixel bounds (data.image_min_pixels and
    # data.image_max_pixels refused, with this); None: the image processor's size is {shortest_edge: min pixels,
    # longest_edge: max pixels} (Qwen-VL)
    fixed_size: str | None = None
    # strategies of PROVEN_STRATEGIES the family is refused under, with why
    refused_strategies: tuple[tuple[str, str], ...] = ()

    @property
    def feature_token(self) -> str:
        return self.image_token or self.placeholder


QWEN_VL = dict(placeholder="<|image_pad|>", token_types="mm_token_type_ids")
CHECKED = {f.model_type: f for f in [
    VisionFamily("qwen2_5_vl", "Qwen2_5_VLProcessor", **QWEN_VL),
    VisionFamily("qwen2_vl", "Qwen2VLProcessor", **QWEN_VL),
    VisionFamily("qwen3_vl", "Qwen3VLProcessor", **QWEN_VL),
    VisionFamily("qwen3_vl_moe", "Qwen3VLProcessor", **QWEN_VL, refused_strategies=(
        ("zero3", "transformers' ZeRO-3 loader does not lay out Qwen3-VL-MoE's expert weights as its ordinary load "
                  "does (size mismatch for ...mlp.experts.down_proj, [4, 32, 64] against [4, 64, 32], "
                  "tests/test_vision_exact.py); use strategy.name: ddp or fsdp"),)),
    VisionFamily("llava", "LlavaProcessor", "<image>",
                 fixed_size="LLaVA resizes every image to its vision tower's size: the same tokens whatever its size"),
    VisionFamily("llava_next", "LlavaNextProcessor", "<image>",
                 fixed_size="LLaVA-NeXT tiles every image on the grids of its config's image_grid_pinpoints: its "
                            "largest grid bounds the tokens"),
    VisionFamily("idefics3", "Idefics3Processor", "<image>",
                 fixed_size="Idefics3 splits every image into tiles of its image processor's max_image_size (and a "
                            "whole view): its size bounds the tiles, not pixels"),
    VisionFamily("gemma3", "Gemma3Processor", "<start_of_image>", image_token="<image_soft_token>",
                 token_types="token_type_ids",
                 fixed_size="Gemma 3 resizes every image to its vision tower's size: the same tokens whatever its "
                            "size (pan-and-scan crops are not used here)",
                 packing_refused="Gemma 3 builds the mask of each image's tokens (they attend to each other both ways) "
                                 "from token_type_ids by a path of its own, and its packed rows were measured not to "
                                 "give their padded loss (1.9e-5 off, tests/test_vision_packing.py): set "
                                 "data.packing: false"),
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
    refused = dict(CHECKED[model_type].refused_strategies)
    if strategy in refused:
        out.append(("strategy.name", f"{model_type} under {strategy}: {refused[strategy]}"))
    if strategy is not None and strategy not in PROVEN_STRATEGIES:
        out.append(("strategy.name", f"strategy {strategy!r} is not proven for image-text-to-text models yet (only "
                    f"{', '.join(PROVEN_STRATEGIES)} are, with images of different sizes across ranks and "
                    f"accumulation); use strategy.name: {' or '.join(PROVEN_STRATEGIES)}"))
    if isinstance(sequence_parallel, int) and sequence_parallel > 1:
        out.append(("strategy.sequence_parallel", "sequence parallelism is not proven for image-text-to-text models "
                    "yet (an example's image tokens would be split over ranks); leave strategy.sequence_parallel at 1"))
    return out


def section_family(section, key: str, does: str) -> tuple[str | None, list[tuple]]:
    """(the checked family of a model section's model, []), or (None, the refusal of `key`, which `does` something
    only an image-text-to-text model of a checked family has)."""
    family = model_type_of(section.name_or_path) if isinstance(section.name_or_path, str) else None
    if family in CHECKED:
        return family, []
    return None, [(key, f"{does}; this model is not one of the families hftrain has checked "
                        f"({', '.join(sorted(CHECKED))}); remove {key}")]


def packing_problems(model_type: str | None, packing: bool) -> list[tuple]:
    """A refusal, as (key, message), of packed rows for a family whose packing is not exact."""
    family = CHECKED.get(model_type)
    if packing and family is not None and family.packing_refused:
        return [("data.packing", family.packing_refused)]
    return []


PIXEL_KEYS = ("image_min_pixels", "image_max_pixels")


def image_size_problems(model_type: str | None, data) -> list[tuple]:
    """Refusals, as (key, message), of data.image_min_pixels / image_max_pixels: on a family that sizes every image
    itself (fixed_size), or out of order."""
    given = {k: getattr(data, k, None) for k in PIXEL_KEYS if getattr(data, k, None) is not None}
    family = CHECKED.get(model_type)
    if not given or family is None:
        return []
    if family.fixed_size:
        return [(f"data.{k}", f"{family.fixed_size}; remove data.{k}") for k in given]
    out = [(f"data.{k}", f"must be a positive number of pixels, not {v}") for k, v in given.items() if v <= 0]
    low, high = given.get("image_min_pixels"), given.get("image_max_pixels")
    if not out and low is not None and high is not None and low > high:
        out.append(("data.image_min_pixels", f"{low} is more than data.image_max_pixels ({high}); lower it"))
    return out


def head_of(section) -> Head:
    """The head of a model section's model: image-text-to-text for a family hftrain has checked, else a causal LM
    (an image-text-to-text model of another family is refused by the preflight check: family_problem)."""
    name = getattr(section, "name_or_path", None)
    return Head.IMAGE_TEXT_TO_TEXT if isinstance(name, str) and model_type_of(name) in CHECKED else Head.CAUSAL_LM


def processor_class(model_type: str) -> type:
    return getattr(transformers, CHECKED[model_type].processor_class)


def family_of(processor) -> VisionFamily:
    """The checked family of a loaded processor, by its class name (processor.images_only keeps the family's)."""
    name = type(processor).__name__
    found = next((f for f in CHECKED.values() if f.processor_class == name), None)
    if found is None:
        raise ValueError(f"{name} is not the processor of a family hftrain has checked ({', '.join(sorted(CHECKED))})")
    return found


def image_token_ids(processor) -> tuple[int, int]:
    """(the id of the placeholder the chat template writes per image, the id of the tokens the image's features
    fill) of a checked family's processor."""
    family, tokenizer = family_of(processor), processor.tokenizer
    return tuple(tokenizer.convert_tokens_to_ids(t) for t in (family.placeholder, family.feature_token))
