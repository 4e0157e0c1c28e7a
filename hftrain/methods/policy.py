"""The policy of the methods built on TRL's trainers (DPO and its relatives, ORPO, KTO, GRPO): the model to tune, the
LoRA config TRL wraps it with, and what preference tuning adds to the run (PreferenceMethod). The reference is TRL's:
the LoRA adapter disabled, a frozen copy, or precomputed log-probs; ORPO and SimPO have none."""

from __future__ import annotations

import dataclasses

from ..config import DataSection, ModelSection, Problems, Recipe
from ..config.fields import is_number
from ..config.mesh_rules import mesh_refusal
from ..constants import QUANTIZED_STRATEGIES
from ..heads import Head, Role
from ..modeling import load_model, lora_config
from ..vision.families import head_of
from .base import Method, ModelSpec
from .modality import modality_of

# data: options of supervised fine-tuning that mean nothing to the TRL-based methods (their value when unset).
SFT_ONLY_DATA = {"packing": False, "assistant_only_loss": True, "completion_only_loss": True,
                 "skip_untrainable": False, "train_turns": "all"}
# Where the TRL-based methods are tested exact (tests/test_preference.py, test_orpo_kto.py, test_grpo_runs.py).
POLICY_STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")


def load_policy(cfg: ModelSection, head: Head = Head.CAUSAL_LM, num_labels: int | None = None):
    """The model to tune; with model.lora the base model, for TRL to wrap with `policy_peft_config`: TRL computes the
    reference with that fresh adapter disabled (no copy). A model wrapped beforehand would make TRL copy the adapter
    as a 'ref' adapter, for adapters trained earlier. `num_labels`: a classifier's classes (a reward model's one)."""
    base = cfg if cfg.lora is None else dataclasses.replace(cfg, lora=None)
    return load_model(base, head=head, num_labels=num_labels)


def policy_peft_config(cfg: ModelSection, head: Head = Head.CAUSAL_LM):
    """The LoraConfig TRL wraps the policy (with `head`) with (model.lora), or None."""
    return lora_config(cfg, head) if cfg.lora is not None else None


def sft_only_problems(recipe: Recipe, method: str, rows: str, averaged: str, data: dict | None = None) -> Problems:
    """Supervised fine-tuning's keys asked of a TRL-based `method`: SFT_ONLY_DATA and the method's own `data`
    options, streaming, the CE's averaging, the chunked loss and MoE. `rows`: what the method trains on and why those
    options mean nothing to it; `averaged`: how its loss averages instead."""
    d, out = recipe.data, []
    for key, unset in ({**SFT_ONLY_DATA, **(data or {})}.items() if isinstance(d, DataSection) else ()):
        if getattr(d, key) != unset:
            out.append((f"data.{key}", f"applies to supervised fine-tuning, not to {rows}: remove it"))
    if isinstance(d, DataSection) and d.streaming is True:
        out.append(("data.streaming", f"applies to supervised fine-tuning, not to {method}: remove it"))
    if recipe.typed_training.loss_averaging not in ("token", None):
        out.append(("training.loss_averaging", f"applies to the CE of supervised fine-tuning; {averaged}: remove it"))
    if recipe.typed_training.loss_impl in ("chunked", "fused"):
        out.append(("training.loss_impl", f"applies to supervised fine-tuning (TRL computes {method}'s log-probs "
                    "with its own fused head): remove it"))
    if recipe.moe is not None:
        out.append(("moe", f"is not supported with {method}: train the MoE model with recipes/sft.py"))
    return out


def policy_strategy_problems(recipe: Recipe, name: str, method: str, whole: str) -> Problems:
    """Where a TRL-based `method` runs: a strategy it is tested exact under, never sequence parallelism (`whole`: why
    each rank needs whole sequences), and a quantised policy under DDP only."""
    out: Problems = []
    if name not in POLICY_STRATEGIES:
        out.append(("strategy.name", f"{method} runs under {', '.join(POLICY_STRATEGIES)} (where its exactness is "
                    f"tested), not '{name}': launch with one of those accelerate_configs"))
    if is_number(recipe.strategy.sequence_parallel) and recipe.strategy.sequence_parallel > 1:
        out.append(("strategy.sequence_parallel", f"{method} does not run under sequence parallelism ({whole}): "
                    "remove strategy.sequence_parallel"))
    out += mesh_refusal(recipe, method)
    quantized = recipe.model is not None and recipe.model.quantization is not None
    if quantized and name in QUANTIZED_STRATEGIES and name != "ddp":
        out.append(("strategy.name", f"a quantised policy (DPO, ORPO, KTO, GRPO) is tested under ddp only, not "
                    f"'{name}': use strategy.name: ddp (the 4-bit base is about a quarter of its 16-bit size)"))
    return out


class PreferenceMethod(Method):
    """DPO (and IPO, SimPO), ORPO and KTO in the run: the policy, and TRL's trainer for the loss with hftrain's mixins
    (`trainer_class`), judged by held-out reward accuracy and margin (KTO: margin; its examples are unpaired)."""

    # Those the loss's trainer logs: rewards/accuracies (DPO, ORPO: a pair's chosen reward above its rejected one);
    # ORPO's log odds of the chosen answer over the rejected and its NLL; KTO's KL reference point.
    reported = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen", "eval_rewards/rejected",
                "eval_log_odds_chosen", "eval_nll_loss", "eval_kl", "eval_loss")

    def models(self, recipe: Recipe) -> list[ModelSpec]:
        """The policy, and the frozen copy TRL keeps as the reference where the loss has one and neither LoRA (the
        adapter disabled is the reference) nor precomputed log-probs stand for it: the plan counts it."""
        p, m = recipe.preference, recipe.model
        head = head_of(m)  # a causal LM, or an image-text-to-text model (a method that trains images: modality.py)
        policy = ModelSpec(Role.POLICY, head, m)
        copy = getattr(p, "copies_the_reference", False) and getattr(m, "lora", None) is None
        return [policy, ModelSpec(Role.REFERENCE, head, m, key="model")] if copy else [policy]

    def model(self, run):
        """The policy, prepared for what it reads (an image model's parts frozen: modality.py)."""
        policy = self.policy(run.recipe)
        return modality_of(policy.section).prepare(load_policy(policy.section, policy.head), run.recipe, False)

    def describe(self, recipe):
        return f"preference tuning ({recipe.preference.loss_type} loss, beta={recipe.preference.beta})"

    def trainer(self, run, model, tokenizer, data, callbacks):
        policy = self.policy(run.recipe)
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                                  processing_class=getattr(data, "processor", None) or tokenizer,  # saved beside it
                                  data_collator=getattr(data, "collator", None),  # None: the trainer's own
                                  peft_config=policy_peft_config(policy.section, policy.head), callbacks=callbacks)
