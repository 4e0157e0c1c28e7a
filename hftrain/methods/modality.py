"""The modality axis: what a policy reads, text or images with text, chosen by the policy's model (an
image-text-to-text model of a family hftrain has checked reads images: vision.families.head_of) and carried by one
object a method asks instead of branching on images. A modality owns the data phase (rows read, rendered, labelled,
collated and packed), `hftrain data`'s preview, the TrainingArguments it needs, what it does to the model once loaded
(parts frozen, packed rows' hooks) and the preflight refusals of keys it cannot honour.

A method says which modalities it trains (Method.modalities, by name); a recipe whose policy reads another is refused
under model.name_or_path by `hftrain check` and the run, before anything loads (modality_problems), rather than
trained as a text model: a method gains images by naming them and asking its modality, without code outside its
package."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Recipe
from ..config.mesh_rules import mesh_refusal
from ..data import build_datasets
from ..data.preview import preview
from ..heads import Head
from ..vision.image_pairs import image_pair_problems, read_image_pairs
from ..vision.image_prompts import preview_image_prompts, read_image_prompts
from ..vision.families import (PIXEL_KEYS, head_of, image_size_problems, model_type_of, packing_problems,
                               strategy_problems)
from ..vision.freezing import freeze_section_parts
from ..vision.image_datasets import build_image_datasets
from ..vision.image_preview import image_preview
from ..vision.image_sources import image_data_problems
from ..vision.packing import pack_image_rows
from ..vision.processor import processor_of
from ..vision.unreached import freeze_unreached
from .pairs import ImagePairs, PreferenceData, build_preference_data


@dataclass(frozen=True)
class Modality:
    """Text: data/'s rows through the tokenizer's chat template (the base every modality shares)."""

    name: str = "text"
    described: str = "text"  # how a message names what the policy reads

    def read(self, recipe: Recipe, tokenizer, seed: int):
        """The run's data (train, eval, collator, held-out prompts), every row read and checked."""
        return build_datasets(recipe.data, tokenizer, seed=seed, exact_match=recipe.eval.exact_match)

    def show(self, recipe: Recipe, tokenizer, n: int) -> str:
        """What `hftrain data` prints: the first n rows as they train."""
        return preview(recipe.data, tokenizer, n)

    def read_pairs(self, recipe: Recipe, tokenizer, seed: int) -> PreferenceData:
        """Preference pairs (prompt, chosen, rejected), every row read, checked and measured (methods/pairs.py)."""
        return build_preference_data(recipe.data, bool(getattr(tokenizer, "chat_template", None)), seed=seed,
                                     tokenizer=tokenizer)

    def read_prompts(self, recipe: Recipe, tokenizer, seed: int, read_text, completion_room: int,
                     needs_reference: str | None = None):
        """Prompts to answer, each with its reference answer (online RL); text prompts are read by the method's own
        reader (`read_text()`: GRPO's layouts, tools and all)."""
        return read_text()

    def show_prompts(self, recipe: Recipe, tokenizer, n: int, show_text, completion_room: int) -> str:
        """What `hftrain data` prints of prompts; text prompts are shown by the method's own preview (`show_text()`)."""
        return show_text()

    def arguments(self, kwargs: dict) -> dict:
        """TrainingArguments values this modality needs beside the recipe's."""
        return kwargs

    def prepare(self, model, recipe: Recipe, packing: bool):
        """The policy once loaded: model.freeze's parts left untrained (refused by preflight on a model without
        parts), and what this modality's rows need of the model."""
        freeze_section_parts(model, recipe.model)
        return model

    def problems(self, recipe: Recipe, unit: str) -> list[tuple[str, str]]:
        """(key, message) of the recipe's keys this modality cannot honour, for a method training on `unit` (its
        Method.unit: examples, pairs): for text, the keys that size images."""
        return [(f"data.{k}", f"sizes the images of an image-text-to-text model's rows; this model reads "
                 f"{self.described} only: remove data.{k}")
                for k in PIXEL_KEYS if getattr(recipe.data, k, None) is not None]


@dataclass(frozen=True)
class Images(Modality):
    """Images with text: vision/'s rows rendered and labelled by the model's processor, collated with their pixel
    values, packed per example."""

    name: str = "images"
    described: str = "images (an image-text-to-text model)"

    def read(self, recipe, tokenizer, seed):
        processor = processor_of(recipe.model, recipe.data)
        return build_image_datasets(recipe.data, processor, seed, recipe.eval.exact_match)

    def show(self, recipe, tokenizer, n):
        return image_preview(recipe.data, processor_of(recipe.model, recipe.data), n)

    def read_prompts(self, recipe, tokenizer, seed, read_text, completion_room, needs_reference=None):
        """Prompts with images (vision/image_prompts.py), their images decoded by hftrain when the trainer reads
        them; the processor is the trainer's processing class."""
        return read_image_prompts(recipe.data, processor_of(recipe.model, recipe.data), completion_room, seed,
                                  recipe.eval.exact_match, needs_reference)

    def show_prompts(self, recipe, tokenizer, n, show_text, completion_room):
        return preview_image_prompts(recipe.data, processor_of(recipe.model, recipe.data), completion_room, n)

    def read_pairs(self, recipe, tokenizer, seed):
        """Pairs with images (vision/image_pairs.py), batched by TRL's vision collator given hftrain's decoding."""
        processor = processor_of(recipe.model, recipe.data)
        train, held_out = read_image_pairs(recipe.data, processor, seed)
        return PreferenceData(train, held_out, conversational=True,
                              collator=ImagePairs(processor, recipe.data.max_length), processor=processor)

    def arguments(self, kwargs):
        """Image rows keep their images column (the Trainer drops a column the model's forward does not take)."""
        return {**kwargs, "remove_unused_columns": kwargs.get("remove_unused_columns", False)}

    def prepare(self, model, recipe, packing):
        model = super().prepare(model, recipe, packing)
        freeze_unreached(model)  # LLaVA's vision tower above its feature layer: no gradient (DDP waits for it)
        if packing:
            pack_image_rows(model)  # packed image rows: no cache, Qwen-VL's mrope restarted per example
        return model

    def problems(self, recipe, unit):
        """Strategies not proven with images, and data keys image rows (or pairs) cannot honour."""
        family = model_type_of(recipe.model.name_or_path)
        out = strategy_problems(family, getattr(recipe.strategy, "name", None),
                                getattr(recipe.strategy, "sequence_parallel", None))
        out += mesh_refusal(recipe, "an image-text-to-text model")
        if recipe.data is not None:
            out += packing_problems(family, recipe.data.packing)
            out += image_size_problems(family, recipe.data)
            out += image_pair_problems(recipe.data) if unit == "pairs" else image_data_problems(recipe.data)
        if unit == "pairs" and getattr(getattr(recipe, "preference", None), "precompute_ref_log_probs", False):
            out.append(("preference.precompute_ref_log_probs", "TRL computes the reference's log-probs of image "
                        "pairs as it trains (it refuses to run a forward over the whole image dataset first): "
                        "remove it"))
        return out + (prompt_problems(recipe) if unit == "prompts" else [])


def prompt_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """What online RL on prompts with images does not do yet, by key: reward models (they read text), tools and
    environments (their turns are text), vLLM generation (not run with images here)."""
    section, out = getattr(recipe, "grpo", None), []
    for i, reward in enumerate(getattr(section, "rewards", None) or []):
        if isinstance(getattr(reward, "model", None), str):
            out.append((f"grpo.rewards.{i}.model", "a reward model scores text; prompts with images are rewarded by "
                        "functions (exact_match, or your own): replace it with a function"))
    for key in ("tools", "environment"):
        if getattr(section, key, None):
            out.append((f"grpo.{key}", "tool calls over prompts with images are not done yet: remove it"))
    if getattr(section, "generation", None) == "vllm":
        out.append(("grpo.generation", "vLLM generation with images is not run here yet: use transformers"))
    return out


TEXT, IMAGES = Modality(), Images()


def modality_of(section) -> Modality:
    """What the model of a recipe's model section reads."""
    return IMAGES if head_of(section) is Head.IMAGE_TEXT_TO_TEXT else TEXT


def modality_problems(method, recipe: Recipe) -> list[tuple[str, str]]:
    """A policy whose modality the method does not train, under model.name_or_path (its own rules then unasked);
    else the modality's own refusals."""
    modality = modality_of(recipe.model)
    if modality.name not in method.modalities:
        return [("model.name_or_path", f"{recipe.model.name_or_path} reads {modality.described}; the {method.name} "
                 f"method trains {' or '.join(method.modalities)} only: choose a model that reads "
                 f"{' or '.join(method.modalities)}, or a method that trains {modality.name}")]
    return modality.problems(recipe, method.unit)
