"""Outcome reward models: a sequence classifier with one label scores a whole answer, trained on chosen/rejected pairs
with the Bradley-Terry loss -log sigmoid(score(chosen) - score(rejected) [- margin]) [+ c * mean((score(chosen) +
score(rejected))^2)], on TRL 1.16's RewardTrainer (its collator: a micro-batch's chosen rows then its rejected rows;
its loss, margin column and centring term) with hftrain's run mixins, and what TRL lacks, written here:

- the loss is the exact mean over the pairs of the optimizer step's global batch (losses.PairMeanMixin): TRL returns
  the micro-batch's mean (both terms are means over its pairs), which the Trainer and DDP would average again;
- the held-out pair accuracy (score(chosen) > score(rejected)) and mean margin over every held-out pair of every rank
  (TRL logs the mean of each rank's micro-batch means): eval_pair_accuracy, eval_mean_margin.

The model: the policy loaded as a sequence classifier with one label (modeling.load_model sets its pad token);
with model.lora TRL wraps it with a SEQ_CLS adapter whose score head is trained and saved whole (modules_to_save).
"""

from __future__ import annotations

import dataclasses

import torch
from trl import RewardConfig, RewardTrainer

from ...config import HFTrainOptions, Recipe
from ...heads import Head, Role
from ...losses import PairMeanMixin
from ...trainer import RUN_MIXINS
from .. import registry
from ..base import Method, ModelSpec
from ..policy import load_policy, policy_peft_config
from .figures import pair_figures
from .reward_pairs import read_reward_pairs, show_pairs

HEAD = Head.SEQUENCE_CLASSIFICATION
LABELS = 1  # one score per sequence


@dataclasses.dataclass
class HFRewardConfig(RewardConfig, HFTrainOptions):
    """TRL's RewardConfig with hftrain's options."""


def reward_config(recipe: Recipe, **kwargs) -> HFRewardConfig:
    """The run's arguments (`kwargs`: every TrainingArguments value launch.setup resolved) plus the reward section's."""
    return HFRewardConfig(**kwargs, max_length=recipe.data.max_length, disable_dropout=True,
                          center_rewards_coefficient=recipe.reward.center_rewards_coefficient)


class PairAccuracyMixin:
    """Held-out pair accuracy and mean margin over every held-out pair of every rank: each evaluated micro-batch's
    score differences gathered with gather_for_metrics (which leaves out the pairs the last batches repeat to keep
    the ranks even), added to the evaluation's metrics."""

    _margins: list | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss, outputs = out
        if not model.training and self._margins is not None:
            chosen, rejected = torch.chunk(outputs.logits.detach().float().squeeze(-1), chunks=2)
            self._margins.append(self.accelerator.gather_for_metrics(chosen - rejected).cpu())
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        self._margins = []
        try:
            output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        finally:
            margins, self._margins = self._margins, None
        if margins:
            margin = torch.cat(margins)
            accuracy, mean_margin = pair_figures(margin)
            output.metrics[f"{metric_key_prefix}_pair_accuracy"] = accuracy
            output.metrics[f"{metric_key_prefix}_mean_margin"] = mean_margin
            output.metrics[f"{metric_key_prefix}_pairs"] = margin.numel()
        return output


class OutcomeRewardTrainer(*RUN_MIXINS, PairAccuracyMixin, PairMeanMixin, RewardTrainer):
    """TRL's RewardTrainer (its collator, loss and metrics) with hftrain's checkpoints, guards and compression, the
    exact pair mean and the held-out pair accuracy; `args` is an HFRewardConfig (reward_config)."""


class OutcomeRewardMethod(Method):
    """An outcome reward model in the run: a sequence classifier with one label as the policy."""

    reported = ("eval_pair_accuracy", "eval_mean_margin", "eval_loss")

    def models(self, recipe):
        return [ModelSpec(Role.POLICY, HEAD, recipe.model, num_labels=LABELS)]

    def model(self, run):
        policy = self.policy(run.recipe)
        return load_policy(policy.section, policy.head, num_labels=policy.num_labels)

    def describe(self, recipe):
        r = recipe.reward
        extra = "".join([f", margin column {r.margin}" if r.margin else "",
                         f", reward centring {r.center_rewards_coefficient}" if r.center_rewards_coefficient else ""])
        return f"outcome reward modelling (Bradley-Terry on chosen/rejected pairs{extra})"

    def trainer(self, run, model, tokenizer, data, callbacks):
        policy = self.policy(run.recipe)
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                                  processing_class=tokenizer,
                                  peft_config=policy_peft_config(policy.section, policy.head), callbacks=callbacks)


METHOD = OutcomeRewardMethod(
    entry=registry.REWARD, read=read_reward_pairs, unit="pairs", show=show_pairs, arguments=reward_config,
    trainer_class=OutcomeRewardTrainer, hub_tag="reward-model")
