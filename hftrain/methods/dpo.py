"""Preference tuning: TRL's DPOTrainer with hftrain's run mixins (staged checkpoints, guards, compression; trainer/),
and what TRL 1.16 lacks, written here:

- the loss is the exact mean over the preference pairs of the optimizer step's global batch (losses.pair_mean_share):
  TRL returns a per-micro-batch mean that the Trainer divides by the accumulation steps, a mean of means;
- SimPO (reference-free, length-normalised, target margin gamma): DPOTrainer 1.16 has no SimPO (only the experimental
  CPO trainer does). Its `sigmoid_norm` loss is -logsigmoid(beta * (chosen/|chosen| - rejected/|rejected|)) of the
  log-ratios to the reference; with the reference log-probs set to gamma/beta * |chosen| and 0 instead of computed,
  that is SimPO's -logsigmoid(beta * (avg logp chosen - avg logp rejected) - gamma), and no reference model is built
  nor run. The rewards TRL logs are then beta * (logp - that constant);
- preference.label_smoothing with sigmoid runs TRL's `robust` loss (noise-robust DPO, an unbiased loss under that
  flip probability): TRL 1.16's sigmoid loss ignores label_smoothing.

The reference model: with LoRA TRL disables the adapter (no copy); otherwise it loads a frozen copy from the model's
folder, or (preference.precompute_ref_log_probs) runs it once over the data before training and keeps none.
"""

from __future__ import annotations

import dataclasses

import torch
from trl import DPOConfig, DPOTrainer

from .. import losses
from ..losses import GlobalBatchMixin
from ..config import HFTrainOptions, PreferenceSection, Recipe
from .pairs import build_preference_data
from ..trainer import RUN_MIXINS
from .base import first_rows, has_template
from .policy import PreferenceMethod

SIMPO_GAMMA = 0.5  # SimPO's paper's default target margin (preference.simpo_gamma unset)


def trl_loss(p: PreferenceSection) -> str:
    """TRL's loss_type for a preference section (see the module docstring)."""
    if p.loss_type == "simpo":
        return "sigmoid_norm"
    if p.loss_type == "sigmoid" and p.label_smoothing > 0:
        return "robust"
    return p.loss_type


@dataclasses.dataclass
class HFDPOConfig(DPOConfig, HFTrainOptions):
    """TRL's DPOConfig with hftrain's options, and SimPO's margin (set: the loss is SimPO's)."""

    simpo_gamma: float | None = dataclasses.field(
        default=None, metadata={"help": "SimPO: the target margin gamma; None: not SimPO."})


def dpo_config(recipe: Recipe, **kwargs) -> HFDPOConfig:
    """The run's arguments (`kwargs`: every TrainingArguments value launch.setup resolved) plus the preference
    section's. A reference-free loss takes the precompute path, whose reference log-probs PreferenceTrainer sets."""
    p = recipe.preference
    simpo = p.loss_type == "simpo"
    return HFDPOConfig(**kwargs, beta=p.beta, loss_type=[trl_loss(p)], label_smoothing=p.label_smoothing,
                       precompute_ref_log_probs=p.precompute_ref_log_probs or simpo,
                       simpo_gamma=(SIMPO_GAMMA if p.simpo_gamma is None else p.simpo_gamma) if simpo else None,
                       max_length=recipe.data.max_length, truncation_mode="keep_start", disable_dropout=True)


class PairMeanMixin(GlobalBatchMixin):
    """The preference loss as the exact mean over the pairs of the optimizer step's global batch
    (losses.pair_mean_share), from the per-micro-batch mean a TRL trainer returns."""

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The pairs of the optimizer step over every micro-batch and rank (a batch holds chosen then rejected rows)."""
        if not batch_samples or "input_ids" not in batch_samples[0]:
            return None
        return self.global_sum(torch.tensor(sum(b["input_ids"].shape[0] // 2 for b in batch_samples), device=device))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs)
        if not model.training or num_items_in_batch is None:  # eval: the micro-batch's mean, as TRL returns it
            return out
        loss, outputs = out if return_outputs else (out, None)
        loss = losses.pair_mean_share(loss, inputs["input_ids"].shape[0] // 2, num_items_in_batch,
                                      self.data_parallel_size())
        return (loss, outputs) if return_outputs else loss


class PreferenceTrainer(*RUN_MIXINS, PairMeanMixin, DPOTrainer):
    """TRL's DPOTrainer (its loss, batches, metrics and eval) with hftrain's checkpoints, guards and compression, and
    the exact pair mean; `args` is an HFDPOConfig (dpo_config)."""

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """SimPO needs no reference: its constant 'reference log-probs' are set instead of computed."""
        gamma = self.args.simpo_gamma
        if gamma is None:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        limit = self.args.max_length

        def add(row):  # the chosen tokens the collator keeps (keep_start truncation at max_length)
            kept = len(row["chosen_ids"]) if limit is None else max(0, min(len(row["chosen_ids"]),
                                                                            limit - len(row["prompt_ids"])))
            return {"ref_chosen_logps": gamma / self.beta * kept, "ref_rejected_logps": 0.0}

        return dataset.map(add, desc=f"SimPO margin for the {name} dataset")


def read_pairs(recipe: Recipe, tokenizer, world_size: int, seed: int):
    """Prompt/chosen/rejected pairs, each row checked and measured as TRL will truncate them (data.preference)."""
    return build_preference_data(recipe.data, has_template(tokenizer), seed=seed, tokenizer=tokenizer)


METHOD = PreferenceMethod(
    name="dpo", script="dpo", section="preference", example="preference: {loss_type: sigmoid, beta: 0.1}",
    selects=lambda recipe: recipe.preference is not None and recipe.preference.loss_type not in ("orpo", "kto"),
    read=read_pairs, unit="pairs", show=lambda recipe, tokenizer, n: first_rows(METHOD, recipe, tokenizer, n),
    arguments=dpo_config, trainer_class=PreferenceTrainer)
