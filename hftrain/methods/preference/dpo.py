"""Preference tuning: TRL's DPOTrainer with hftrain's run mixins (staged checkpoints, guards, compression; trainer/),
and what TRL 1.16 lacks, written here:

- the loss is the exact mean over the preference pairs of the optimizer step's global batch (losses.pair_mean_share):
  TRL returns a per-micro-batch mean that the Trainer divides by the accumulation steps, a mean of means;
- preference.label_smoothing with sigmoid runs TRL's `robust` loss (noise-robust DPO, an unbiased loss under that
  flip probability): TRL 1.16's sigmoid loss ignores label_smoothing.

The reference model: with LoRA TRL disables the adapter (no copy); otherwise it loads a frozen copy from the model's
folder, or (preference.precompute_ref_log_probs) runs it once over the data before training and keeps none.
"""

from __future__ import annotations

import dataclasses

from trl import DPOConfig, DPOTrainer

from ...losses import PairMeanMixin
from ...config import HFTrainOptions, Recipe
from ...trainer import RUN_MIXINS
from ..base import first_rows
from ..fused_head import FusedHeadMixin
from ..modality import modality_of
from .. import registry
from ..policy import PreferenceMethod
from .preference_section import PreferenceSection

def trl_loss(p: PreferenceSection) -> str:
    """TRL's loss_type for a preference section (see the module docstring)."""
    if p.loss_type == "sigmoid" and p.label_smoothing > 0:
        return "robust"
    return p.loss_type


@dataclasses.dataclass
class HFDPOConfig(DPOConfig, HFTrainOptions):
    """TRL's DPOConfig with hftrain's options."""


def preference_values(recipe: Recipe) -> dict:
    """The preference section's values of TRL's DPOConfig."""
    p = recipe.preference
    return dict(beta=p.beta, loss_type=[trl_loss(p)], label_smoothing=p.label_smoothing,
                precompute_ref_log_probs=p.precompute_ref_log_probs, max_length=recipe.data.max_length,
                truncation_mode="keep_start", disable_dropout=True)


def dpo_config(recipe: Recipe, **kwargs) -> HFDPOConfig:
    """The run's arguments (`kwargs`: every TrainingArguments value launch.setup resolved, and those the policy's
    modality needs) plus the preference section's."""
    return HFDPOConfig(**modality_of(recipe.model).arguments(kwargs), **preference_values(recipe))


class PreferenceTrainer(*RUN_MIXINS, PairMeanMixin, FusedHeadMixin, DPOTrainer):
    """TRL's DPOTrainer (its loss, batches, metrics and eval) with hftrain's checkpoints, guards and compression, the
    exact pair mean, and its fused head's gradient reduced under FSDP2 (methods/fused_head.py); `args` is an
    HFDPOConfig (dpo_config)."""


def read_pairs(recipe: Recipe, tokenizer, world_size: int, seed: int):
    """Prompt/chosen/rejected pairs of the policy's modality (text, or images: methods/modality.py), each row checked
    and measured as TRL will truncate them."""
    return modality_of(recipe.model).read_pairs(recipe, tokenizer, seed)


METHOD = PreferenceMethod(
    entry=registry.DPO,
    read=read_pairs, unit="pairs", show=lambda recipe, tokenizer, n: first_rows(METHOD, recipe, tokenizer, n),
    arguments=dpo_config, trainer_class=PreferenceTrainer,
    modalities=("text", "images"))  # ipo too: the Hub counts it in DPO's family
