"""The `preference:` section of a recipe (hftrain dpo: sigmoid and ipo in dpo.py, simpo.py, orpo.py, kto.py read
it), and its rules: the section's values, KTO's batches, what the rest of a preference recipe may not ask for, and
where it runs. config builds it as a field of methods.Recipe and asks it for its rules (config.MethodSection)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ...config import DataSource, MethodSection, Problems, Recipe, option
from ...config.fields import is_number as _num
from ..policy import policy_strategy_problems, sft_only_problems

PreferenceLoss = Literal["sigmoid", "ipo", "simpo", "orpo", "kto"]
REFERENCE_FREE = ("simpo", "orpo")  # losses that need no reference model
UNPAIRED = ("kto",)  # losses trained on single examples labelled desirable or not (pairs are split in two)
# The method each loss is trained by (methods/registry.py): sigmoid and ipo are DPO's (dpo.py).
METHOD_OF_LOSS = {"sigmoid": "dpo", "ipo": "dpo", "simpo": "simpo", "orpo": "orpo", "kto": "kto"}


@dataclass
class PreferenceSection(MethodSection):
    HELP = ("Preference tuning (recipes/dpo.py): the loss and its parameters; data rows are prompt/chosen/rejected "
            "(kto: also prompt/completion/label).")

    loss_type: PreferenceLoss = option(
        "sigmoid", "sigmoid: DPO; ipo: IPO (per-token squared loss); simpo: SimPO (reference-free, length-normalised); "
        "orpo: ORPO (reference-free: NLL of the chosen + odds-ratio term); kto: KTO (unpaired examples with a "
        "true/false label, or pairs split in two; KL reference point).")
    beta: float = option(
        0.1, "Strength of the tie to the reference (DPO/IPO/KTO), the reward scale (SimPO), or the weight "
        "lambda of the odds-ratio term (ORPO).")
    label_smoothing: float = option(
        0.0, "sigmoid/simpo: probability that a pair's labels are flipped (conservative DPO), "
        "in [0, 0.5).")
    simpo_gamma: float | None = option(None, "simpo: target reward margin gamma; default 0.5 (SimPO's paper).")
    precompute_ref_log_probs: bool = option(
        False, "sigmoid/ipo/kto without LoRA: compute the reference log-probs once before training and keep no "
        "reference model in memory (else a frozen copy; with LoRA the adapter is disabled, no copy).")
    desirable_weight: float = option(1.0, "kto: weight of the desirable examples' losses (to balance unequal counts).")
    undesirable_weight: float = option(1.0, "kto: weight of the undesirable examples' losses.")

    @property
    def copies_the_reference(self) -> bool:
        """Whether TRL keeps a frozen copy of the policy as the reference for this section (its loss has a reference
        and no precomputed log-probs stand for it; with LoRA the adapter disabled is the reference, no copy)."""
        return self.loss_type not in REFERENCE_FREE and not self.precompute_ref_log_probs

    @property
    def method(self) -> str:
        """The method this section selects (registry.METHODS), by its loss. An unknown loss_type is a problem the
        recipe's checks report; until then DPO, the section's default loss's method, stands for it."""
        return METHOD_OF_LOSS.get(self.loss_type, "dpo")

    def problems(self, recipe: Recipe) -> Problems:
        return preference_problems(recipe)

    def strategy_problems(self, recipe: Recipe, strategy: str) -> Problems:
        return policy_strategy_problems(recipe, strategy, "preference tuning",
                                        whole="TRL scores whole sequences on each rank")


def preference_problems(recipe: Recipe) -> Problems:
    """Rules of the `preference:` section, and what the rest of a preference recipe may not ask for."""
    p, out = recipe.preference, []
    if _num(p.beta) and not (math.isfinite(p.beta) and p.beta > 0):
        out.append(("preference.beta", f"must be a finite number > 0, got {p.beta}"))
    if _num(p.label_smoothing) and not 0.0 <= p.label_smoothing < 0.5:
        out.append(("preference.label_smoothing", f"must be in [0, 0.5), got {p.label_smoothing}"))
    if _num(p.label_smoothing) and p.label_smoothing > 0 and p.loss_type == "ipo":
        out.append(("preference.label_smoothing", "does not apply to loss_type ipo (a squared loss has no labels "
                    "to flip): remove it, or use loss_type sigmoid"))
    if _num(p.label_smoothing) and p.label_smoothing > 0 and p.loss_type in ("orpo", "kto"):
        out.append(("preference.label_smoothing", f"does not apply to loss_type {p.loss_type} (TRL's {p.loss_type} "
                    "loss has no label noise): remove it, or use loss_type sigmoid or simpo"))
    if p.loss_type == "orpo" and recipe.typed_training.include_num_input_tokens_seen not in (None, False, "no"):
        out.append(("training.include_num_input_tokens_seen", "cannot count ORPO's tokens (TRL's ORPO batches hold "
                    "chosen_/rejected_input_ids, not the input_ids the Trainer counts): remove it"))
    _unpaired_problems(recipe, out)
    if p.simpo_gamma is not None and p.loss_type != "simpo":
        out.append(("preference.simpo_gamma", f"applies to loss_type simpo, not '{p.loss_type}': remove it"))
    if _num(p.simpo_gamma) and not (math.isfinite(p.simpo_gamma) and p.simpo_gamma >= 0):
        out.append(("preference.simpo_gamma", f"must be a finite number >= 0, got {p.simpo_gamma}"))
    if p.precompute_ref_log_probs is True and p.loss_type in REFERENCE_FREE:
        out.append(("preference.precompute_ref_log_probs", f"loss_type {p.loss_type} is reference-free: there is "
                    "nothing to precompute; remove it"))
    d = recipe.data
    out += sft_only_problems(recipe, "preference tuning", data={"truncation": "right"},
                             rows="preference pairs (each pair is scored on its chosen and rejected answers whole)",
                             averaged="a preference loss is the mean over the pairs of the global batch")
    for group in ("sources", "eval_sources"):
        for i, s in enumerate(getattr(d, group) if d is not None and isinstance(getattr(d, group), list) else []):
            if isinstance(s, DataSource) and s.format != "auto":
                out.append((f"data.{group}.{i}.format", "preference rows are read by their columns prompt/chosen/"
                            "rejected (rename yours with columns:): remove format"))
    if recipe.eval is not None and _num(recipe.eval.exact_match) and recipe.eval.exact_match > 0:
        out.append(("eval.exact_match", "is not measured by preference tuning (held-out reward accuracy and margins "
                    "are): set it to 0"))
    return out


def _unpaired_problems(recipe: Recipe, out: Problems) -> None:
    """KTO's options, and what its KL reference point needs of the batches (TRL's KTOTrainer: it pairs each prompt
    with the completion of the example before it in a fixed-order micro-batch)."""
    p = recipe.preference
    for key in ("desirable_weight", "undesirable_weight"):
        value = getattr(p, key)
        if _num(value) and value != 1.0 and p.loss_type not in UNPAIRED:
            out.append((f"preference.{key}", f"applies to loss_type kto, not '{p.loss_type}': remove it"))
        elif _num(value) and not (math.isfinite(value) and value > 0):
            out.append((f"preference.{key}", f"must be a finite number > 0, got {value}"))
    if p.loss_type not in UNPAIRED:
        return
    batch = recipe.typed_training.per_device_train_batch_size
    if _num(batch) and batch < 2:
        out.append(("training.per_device_train_batch_size", f"kto needs at least 2 examples per micro-batch, got "
                    f"{batch}: its KL reference point scores each prompt with another example's completion of the "
                    "same micro-batch"))
    sampling = recipe.training.get("train_sampling_strategy")
    if sampling not in (None, "sequential"):
        out.append(("training.train_sampling_strategy", f"must be sequential for kto, got {sampling!r}: the KL "
                    "completions are paired within fixed micro-batches (hftrain shuffles the examples once, with "
                    "training.seed, before they are batched): remove it"))

