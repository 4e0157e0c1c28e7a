"""ORPO (odds-ratio preference optimisation, reference-free): TRL's ORPOTrainer (trl.experimental.orpo: its
tokenising, loss and metrics) with hftrain's run mixins (staged checkpoints, guards, compression; trainer/), and what
TRL 1.16 lacks, written here: the loss exact over the optimizer step's global batch.

TRL returns, for each micro-batch, `NLL - mean(beta * logsigmoid(log odds ratio))`: the NLL is the mean CE over the
micro-batch's chosen tokens (prompt and answer, as TRL and the paper's code compute it), the odds-ratio term a mean
over its pairs (of each answer's mean token log-prob); the Trainer then averages those over the accumulation steps, and
DDP over the ranks: a mean of means, which weighs a token or a pair of a smaller micro-batch more. hftrain trains on

    sum of the chosen tokens' CE / the step's chosen tokens  -  beta * sum of logsigmoid(log odds) / the step's pairs

with both counts taken over every micro-batch of every rank (one gather per step), from the two terms TRL computes
(kept as its `concatenated_forward` and `odds_ratio_loss` return them; nothing of the loss is re-implemented).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from trl.import_utils import TRLExperimentalWarning

from ... import losses
from ...losses import GlobalBatchMixin
from ...config import HFTrainOptions, Recipe
from ...trainer import RUN_MIXINS
from .. import registry
from ..policy import PreferenceMethod
from ..base import first_rows
from .dpo import read_pairs

# hftrain checks what it uses of the experimental ORPO against the installed TRL (tests/test_upstream_contract.py): the
# warning that the API may change is for code that does not.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", TRLExperimentalWarning)
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer


@dataclasses.dataclass
class HFORPOConfig(ORPOConfig, HFTrainOptions):
    """TRL's ORPOConfig with hftrain's options."""


def orpo_config(recipe: Recipe, **kwargs) -> HFORPOConfig:
    """The run's arguments (`kwargs`: every TrainingArguments value launch.setup resolved) plus the preference
    section's: beta is ORPO's lambda, the weight of the odds-ratio term."""
    kwargs.setdefault("remove_unused_columns", False)  # TRL's pair collator reads columns the model does not take
    if "include_num_input_tokens_seen" not in recipe.training:  # its batches hold no input_ids to count (rules.py)
        kwargs["include_num_input_tokens_seen"] = "no"
    return HFORPOConfig(**kwargs, beta=recipe.preference.beta, max_length=recipe.data.max_length,
                        disable_dropout=True)


class OddsRatioExactMixin(GlobalBatchMixin):
    """ORPO's loss exact over the optimizer step's global batch (the module docstring), from TRL's two terms."""

    _orpo_terms: dict | None = None

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """(pairs, chosen tokens the NLL counts) of the optimizer step over every micro-batch and rank."""
        if not batch_samples or "chosen_attention_mask" not in batch_samples[0]:
            return None
        local = torch.tensor([[b["chosen_attention_mask"].shape[0], int(nll_tokens(b))] for b in batch_samples],
                             device=device).sum(0)
        return self.global_sum(local)

    def concatenated_forward(self, model, batch):
        out = super().concatenated_forward(model, batch)
        terms = self._orpo_terms = {"nll": out[4]}  # the chosen tokens' mean CE (TRL's policy_nll_loss)
        if self.aux_loss_enabled:
            terms["aux"] = out[5]
        return out

    def odds_ratio_loss(self, policy_chosen_logps, policy_rejected_logps):
        out = super().odds_ratio_loss(policy_chosen_logps, policy_rejected_logps)
        self._orpo_terms["odds_ratio"] = out[0]  # beta * logsigmoid(log odds), per pair
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs)
        if not model.training or num_items_in_batch is None:  # eval: the micro-batch's loss, as TRL returns it
            return out
        _, outputs = out if return_outputs else (out, None)
        terms, self._orpo_terms = self._orpo_terms, None
        pairs, tokens = num_items_in_batch[0], num_items_in_batch[1]
        loss = (self.step_share(terms["nll"] * nll_tokens(inputs), tokens)
                - self.step_share(terms["odds_ratio"].sum(), pairs))
        if "aux" in terms:  # a router's load-balancing loss (MoE), TRL's coefficient: its mean over the micro-batches
            steps = self.current_gradient_accumulation_steps
            loss = loss + losses.aux_loss_term(terms["aux"], self.aux_loss_coef, steps)
        loss = loss.to(self.args.device)
        return (loss, outputs) if return_outputs else loss


def nll_tokens(batch: dict) -> torch.Tensor:
    """The chosen tokens TRL's ORPO NLL averages over in a micro-batch: every attended position after the first
    (its `concatenated_forward` takes the labels where the attention mask is 1, shifted by one)."""
    return batch["chosen_attention_mask"][:, 1:].sum()


class ORPOPreferenceTrainer(*RUN_MIXINS, OddsRatioExactMixin, ORPOTrainer):
    """TRL's ORPOTrainer (its tokenising, loss terms, metrics and eval) with hftrain's checkpoints, guards and
    compression, and the exact loss; `args` is an HFORPOConfig (orpo_config)."""


METHOD = PreferenceMethod(
    entry=registry.ORPO,
    read=read_pairs, unit="pairs", show=lambda recipe, tokenizer, n: first_rows(METHOD, recipe, tokenizer, n),
    arguments=orpo_config, trainer_class=ORPOPreferenceTrainer)
