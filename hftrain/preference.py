"""Preference tuning: TRL's DPOTrainer with hftrain's Trainer underneath (staged checkpoints, guards, compression),
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
from transformers import TrainingArguments
from trl import DPOConfig, DPOTrainer

from . import losses
from .config import ModelSection, PreferenceSection, Recipe
from .modeling import load_model, lora_config
from .trainer import HFTrainer

SIMPO_GAMMA = 0.5  # SimPO's paper's default target margin (preference.simpo_gamma unset)


def load_policy(cfg: ModelSection):
    """(model, peft_config): with model.lora the base model and its LoraConfig, for TRL to wrap: TRL computes the
    reference with that fresh adapter disabled (no copy). A model wrapped beforehand would make TRL copy the adapter
    as a 'ref' adapter, for adapters trained earlier."""
    if cfg.lora is None:
        return load_model(cfg), None
    return load_model(dataclasses.replace(cfg, lora=None)), lora_config(cfg)


def trl_loss(p: PreferenceSection) -> str:
    """TRL's loss_type for a preference section (see the module docstring)."""
    if p.loss_type == "simpo":
        return "sigmoid_norm"
    if p.loss_type == "sigmoid" and p.label_smoothing > 0:
        return "robust"
    return p.loss_type


def dpo_config(args: TrainingArguments, recipe: Recipe) -> DPOConfig:
    """DPOConfig with every TrainingArguments value of the run (launch.setup built them) plus the preference
    section's. A reference-free loss takes the precompute path, whose reference log-probs PreferenceTrainer sets."""
    p = recipe.preference
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
    return DPOConfig(**values, beta=p.beta, loss_type=[trl_loss(p)], label_smoothing=p.label_smoothing,
                     precompute_ref_log_probs=p.precompute_ref_log_probs or p.loss_type == "simpo",
                     max_length=recipe.data.max_length, truncation_mode="keep_start", disable_dropout=True)


class PreferenceTrainer(DPOTrainer, HFTrainer):
    """DPOTrainer first in the method order (its loss, batches, metrics and eval), HFTrainer below it (checkpoints,
    guards, compression, engine check), transformers' Trainer at the bottom."""

    def __init__(self, *args, preference: PreferenceSection, strategy: str | None = None, compression=None,
                 max_bad_steps: int = 0, resume_weights_only: bool = False, **kwargs):
        self.preference = preference
        # DPOTrainer builds HFTrainer without hftrain's keywords: HFTrainer.__init__ reads them from here.
        self.hftrain_options = {"strategy": strategy, "compression": compression, "max_bad_steps": max_bad_steps,
                                "resume_weights_only": resume_weights_only}
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = True  # compute_loss returns the share of the global mean (losses.py)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """SimPO needs no reference: its constant 'reference log-probs' are set instead of computed."""
        if self.preference.loss_type != "simpo":
            return super()._precompute_ref_logps(dataset, name, batch_size)
        gamma = SIMPO_GAMMA if self.preference.simpo_gamma is None else self.preference.simpo_gamma
        limit = self.args.max_length

        def add(row):  # the chosen tokens the collator keeps (keep_start truncation at max_length)
            kept = len(row["chosen_ids"]) if limit is None else max(0, min(len(row["chosen_ids"]),
                                                                            limit - len(row["prompt_ids"])))
            return {"ref_chosen_logps": gamma / self.beta * kept, "ref_rejected_logps": 0.0}

        return dataset.map(add, desc=f"SimPO margin for the {name} dataset")

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The pairs of the optimizer step over every micro-batch and rank (a batch holds chosen then rejected rows)."""
        if not batch_samples or "input_ids" not in batch_samples[0]:
            return None
        local = torch.tensor(sum(b["input_ids"].shape[0] // 2 for b in batch_samples), device=device)
        return self.accelerator.gather(local.reshape(1)).sum() if self.args.world_size > 1 else local

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs)
        if not model.training or num_items_in_batch is None:  # eval: the micro-batch's mean, as TRL returns it
            return out
        loss, outputs = out if return_outputs else (out, None)
        dp_size = self.accelerator.num_processes // self.get_tp_size()
        loss = losses.pair_mean_share(loss, inputs["input_ids"].shape[0] // 2, num_items_in_batch, dp_size)
        self._guard_loss(loss)  # finite or stop (guards.py)
        return (loss, outputs) if return_outputs else loss
