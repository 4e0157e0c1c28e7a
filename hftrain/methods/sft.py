"""Supervised fine-tuning: transformers' Trainer with every hftrain concern (trainer.SFTTrainer), on examples rendered
and labelled from any layout (data/), previewed by `hftrain data` as the model sees them."""

from __future__ import annotations

from ..config import HFTrainingArguments, Recipe
from ..data import build_datasets
from ..data.preview import preview
from ..trainer import SFTTrainer
from .base import Method


def read(recipe: Recipe, tokenizer, world_size: int, seed: int):
    return build_datasets(recipe.data, tokenizer, seed=seed, exact_match=recipe.eval.exact_match)


METHOD = Method(name="sft", script="sft", section=None, example=None, selects=lambda recipe: True, read=read,
                show=lambda recipe, tokenizer, n: preview(recipe.data, tokenizer, n),
                arguments=lambda recipe, **kwargs: HFTrainingArguments(**kwargs), trainer_class=SFTTrainer)
