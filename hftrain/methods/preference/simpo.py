"""SimPO (reference-free, length-normalised, with a target margin gamma) on TRL's DPOTrainer with hftrain's mixins and
the exact pair mean (dpo.py's PreferenceTrainer): DPOTrainer 1.16 has no SimPO (only the experimental CPO trainer
does), so it is written here. TRL's `sigmoid_norm` loss is -logsigmoid(beta * (chosen/|chosen| -
rejected/|rejected|)) of the log-ratios to the reference; with the reference log-probs set to gamma/beta * |chosen|
and 0 instead of computed, that is SimPO's -logsigmoid(beta * (avg logp chosen - avg logp rejected) - gamma), and no
reference model is built nor run. The rewards TRL logs are then beta * (logp - that constant).
"""

from __future__ import annotations

import dataclasses

from ...config import Recipe
from ..base import first_rows
from .dpo import HFDPOConfig, PreferenceTrainer, preference_values, read_pairs
from .. import registry
from ..policy import PreferenceMethod

SIMPO_GAMMA = 0.5  # SimPO's paper's default target margin (preference.simpo_gamma unset)
TRL_LOSS = "sigmoid_norm"  # the length-normalised sigmoid loss, against the constant reference below


@dataclasses.dataclass
class HFSimPOConfig(HFDPOConfig):
    """HFDPOConfig with SimPO's target margin."""

    simpo_gamma: float = dataclasses.field(default=SIMPO_GAMMA, metadata={"help": "SimPO: the target margin gamma."})


def simpo_config(recipe: Recipe, **kwargs) -> HFSimPOConfig:
    """DPO's arguments with TRL's length-normalised loss, and the precompute path, whose reference log-probs
    SimPOTrainer sets instead of computing."""
    gamma = recipe.preference.simpo_gamma
    return HFSimPOConfig(**kwargs, **{**preference_values(recipe), "loss_type": [TRL_LOSS],
                                      "precompute_ref_log_probs": True},
                         simpo_gamma=SIMPO_GAMMA if gamma is None else gamma)


class SimPOTrainer(PreferenceTrainer):
    """PreferenceTrainer whose 'reference log-probs' are SimPO's constants (no reference is computed)."""

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        gamma, limit = self.args.simpo_gamma, self.args.max_length

        def add(row):  # the chosen tokens the collator keeps (keep_start truncation at max_length)
            kept = len(row["chosen_ids"]) if limit is None else max(0, min(len(row["chosen_ids"]),
                                                                            limit - len(row["prompt_ids"])))
            return {"ref_chosen_logps": gamma / self.beta * kept, "ref_rejected_logps": 0.0}

        return dataset.map(add, desc=f"SimPO margin for the {name} dataset")


METHOD = PreferenceMethod(
    entry=registry.SIMPO,
    read=read_pairs, unit="pairs", show=lambda recipe, tokenizer, n: first_rows(METHOD, recipe, tokenizer, n),
    arguments=simpo_config, trainer_class=SimPOTrainer, hub_tag="dpo")  # the Hub counts SimPO in DPO's family
