"""The `reward:` section of a recipe (hftrain reward), and its rules: its `kind` picks the method (outcome: a score
per sequence from chosen/rejected pairs, outcome.py), the options each kind reads (an option of another kind is
refused, never ignored), what the rest of a reward recipe may not ask for, and where it runs. config builds it as a
field of methods.Recipe and asks it for its rules (config.MethodSection)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ...config import DataSource, MethodSection, Problems, Recipe, option
from ...config.fields import is_number
from ..policy import policy_strategy_problems, sft_only_problems

RewardKind = Literal["outcome", "process"]
# The method each kind is trained by (methods/registry.py); a kind with no method yet is refused by the rules.
METHOD_OF_KIND = {"outcome": "outcome_reward", "process": "process_reward"}
# The options each kind reads beyond `kind`, and their value when unset (an option of another kind is refused).
OPTIONS_OF_KIND = {"outcome": {"margin": None, "center_rewards_coefficient": None},
                   "process": {"step_separator": "\n", "train_on_last_step_only": False}}


@dataclass
class RewardSection(MethodSection):
    HELP = ("Reward modelling (recipes/reward.py): kind outcome trains a sequence classifier that scores a whole "
            "answer from prompt/chosen/rejected pairs (Bradley-Terry); kind process trains a token classifier that "
            "scores each reasoning step from prompt/completions/labels rows.")

    kind: RewardKind = option(
        "outcome", "outcome: one score per sequence, trained on prompt/chosen/rejected pairs (Bradley-Terry loss "
        "-log sigmoid(score(chosen) - score(rejected))); process: a score per reasoning step.")
    margin: str | None = option(
        None, "outcome: the column holding each pair's margin (a number): the loss becomes "
        "-log sigmoid(score(chosen) - score(rejected) - margin) (Llama 2's margin by preference strength).")
    center_rewards_coefficient: float | None = option(
        None, "outcome: weight of the centring term coefficient * mean((score(chosen) + score(rejected))^2), which "
        "keeps the scores near 0 (Eisenstein et al. 2023); a number > 0.")
    step_separator: str = option(
        "\n", "process: the text after each step (the last one too); its token carries the step's label. It must be "
        "one token the tokenizer keeps apart from its neighbours, and no step may hold it.")
    train_on_last_step_only: bool = option(
        False, "process: train on the last step's label only (the others -100); held-out rows keep every step's.")

    @property
    def method(self) -> str:
        """The method this section selects (registry.METHODS), by its kind. A kind with no method is a problem the
        recipe's checks report; until then the outcome method stands for it."""
        return METHOD_OF_KIND.get(self.kind, "outcome_reward")

    def problems(self, recipe: Recipe) -> Problems:
        return reward_problems(recipe)

    def strategy_problems(self, recipe: Recipe, strategy: str) -> Problems:
        return policy_strategy_problems(recipe, strategy, "reward modelling",
                                        whole="each sequence is scored whole at its last token on one rank")


def option_problems(section: RewardSection) -> Problems:
    """The kind, its options' values, and every option that belongs to another kind."""
    out: Problems = []
    if section.kind not in METHOD_OF_KIND:
        out.append(("reward.kind", f"kind {section.kind!r} is not built yet: use kind outcome"))
    mine = OPTIONS_OF_KIND.get(section.kind, {})
    for kind, options in OPTIONS_OF_KIND.items():
        for key, unset in options.items():
            if key not in mine and getattr(section, key) != unset:
                out.append((f"reward.{key}", f"applies to kind {kind}, not {section.kind}: remove it"))
    coefficient = section.center_rewards_coefficient
    if is_number(coefficient) and not (math.isfinite(coefficient) and coefficient > 0):
        out.append(("reward.center_rewards_coefficient", f"must be a finite number > 0, got {coefficient} (remove "
                    "it for no centring)"))
    if not isinstance(section.step_separator, str) or not section.step_separator:
        out.append(("reward.step_separator", f"must be non-empty text, got {section.step_separator!r}"))
    if isinstance(section.margin, str) and not section.margin.strip():
        out.append(("reward.margin", "must name the column holding each pair's margin, got an empty name"))
    return out


def reward_problems(recipe: Recipe) -> Problems:
    """Rules of the `reward:` section, and what the rest of a reward recipe may not ask for."""
    out = option_problems(recipe.reward)
    out += sft_only_problems(recipe, "reward modelling", data={"truncation": "right"},
                             rows="reward pairs (each answer is scored whole at its last token)",
                             averaged="a reward model's loss is the mean over the pairs of the global batch")
    d = recipe.data
    for group in ("sources", "eval_sources"):
        for i, s in enumerate(getattr(d, group) if d is not None and isinstance(getattr(d, group), list) else []):
            if isinstance(s, DataSource) and s.format != "auto":
                rows = ("step rows", "prompt/completions/labels") if recipe.reward.kind == "process" else (
                    "reward pairs", "prompt/chosen/rejected")
                out.append((f"data.{group}.{i}.format", f"{rows[0]} are read by their columns {rows[1]} (rename "
                            "yours with columns:): remove format"))
    if recipe.eval is not None and is_number(recipe.eval.exact_match) and recipe.eval.exact_match > 0:
        out.append(("eval.exact_match", "is not measured by a reward model (it generates nothing; held-out pair "
                    "accuracy and mean margin are): set it to 0"))
    if recipe.model is not None and recipe.model.quantization is not None:
        out.append(("model.quantization", "is not supported for reward models (the score head is trained whole): "
                    "remove it"))
    return out
