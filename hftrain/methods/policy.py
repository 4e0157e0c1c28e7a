"""The policy of the methods built on TRL's trainers (DPO and its relatives, ORPO, KTO, GRPO): the model to tune, the
LoRA config TRL wraps it with, and what preference tuning adds to the run (PreferenceMethod). The reference is TRL's:
the LoRA adapter disabled, a frozen copy, or precomputed log-probs; ORPO and SimPO have none."""

from __future__ import annotations

import dataclasses

from ..config import ModelSection
from ..modeling import load_model, lora_config
from .base import Method


def load_policy(cfg: ModelSection):
    """The model to tune; with model.lora the base model, for TRL to wrap with `policy_peft_config`: TRL computes the
    reference with that fresh adapter disabled (no copy). A model wrapped beforehand would make TRL copy the adapter
    as a 'ref' adapter, for adapters trained earlier."""
    return load_model(cfg if cfg.lora is None else dataclasses.replace(cfg, lora=None))


def policy_peft_config(cfg: ModelSection):
    """The LoraConfig TRL wraps the policy with (model.lora), or None."""
    return lora_config(cfg) if cfg.lora is not None else None


class PreferenceMethod(Method):
    """DPO (and IPO, SimPO), ORPO and KTO in the run: the policy, and TRL's trainer for the loss with hftrain's mixins
    (`trainer_class`), judged by held-out reward accuracy and margin (KTO: margin; its examples are unpaired)."""

    # Those the loss's trainer logs: rewards/accuracies (DPO, ORPO: a pair's chosen reward above its rejected one);
    # ORPO's log odds of the chosen answer over the rejected and its NLL; KTO's KL reference point.
    reported = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen", "eval_rewards/rejected",
                "eval_log_odds_chosen", "eval_nll_loss", "eval_kl", "eval_loss")

    def model(self, run):
        return load_policy(run.recipe.model)

    def trainer(self, run, model, tokenizer, data, callbacks):
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                                  processing_class=tokenizer, peft_config=policy_peft_config(run.recipe.model),
                                  callbacks=callbacks)
