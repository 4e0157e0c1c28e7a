"""The sections of the methods beyond SFT: `preference:` (hftrain dpo: sigmoid, ipo, simpo, orpo, kto) and `grpo:`
(hftrain grpo). Typed fields with defaults and help, nothing that runs; `sections.Recipe` holds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import _f

PreferenceLoss = Literal["sigmoid", "ipo", "simpo", "orpo", "kto"]
REFERENCE_FREE = ("simpo", "orpo")  # losses that need no reference model
UNPAIRED = ("kto",)  # losses trained on single examples labelled desirable or not (pairs are split in two)


@dataclass
class PreferenceSection:
    loss_type: PreferenceLoss = _f(
        "sigmoid", "sigmoid: DPO; ipo: IPO (per-token squared loss); simpo: SimPO (reference-free, length-normalised); "
        "orpo: ORPO (reference-free: NLL of the chosen + odds-ratio term); kto: KTO (unpaired examples with a "
        "true/false label, or pairs split in two; KL reference point).")
    beta: float = _f(0.1, "Strength of the tie to the reference (DPO/IPO/KTO), the reward scale (SimPO), or the weight "
                     "lambda of the odds-ratio term (ORPO).")
    label_smoothing: float = _f(0.0, "sigmoid/simpo: probability that a pair's labels are flipped (conservative DPO), "
                                "in [0, 0.5).")
    simpo_gamma: float | None = _f(None, "simpo: target reward margin gamma; default 0.5 (SimPO's paper).")
    precompute_ref_log_probs: bool = _f(
        False, "sigmoid/ipo/kto without LoRA: compute the reference log-probs once before training and keep no "
        "reference model in memory (else a frozen copy; with LoRA the adapter is disabled, no copy).")
    desirable_weight: float = _f(1.0, "kto: weight of the desirable examples' losses (to balance unequal counts).")
    undesirable_weight: float = _f(1.0, "kto: weight of the undesirable examples' losses.")


GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]
BUILTIN_REWARDS = ("exact_match", "regex", "length_penalty")


@dataclass
class RewardSpec:
    function: str = _f(
        help="exact_match (1 when the completion equals the reference answer, whitespace-stripped), regex (1 when the "
        "whole completion matches `pattern`), length_penalty (-tokens beyond `limit` / grpo.max_completion_length), "
        "or your own as module:function or path/to/file.py:function, called as fn(prompts, completions, reference, "
        "**kwargs) and returning one number (or None: does not apply) per completion.")
    weight: float = _f(1.0, "Weight of this reward in the sum that scores each completion.")
    pattern: str | None = _f(None, "regex: the pattern the whole completion must match (Python re.fullmatch, DOTALL).")
    limit: int | None = _f(None, "length_penalty: completion tokens that cost nothing; default 0.")


@dataclass
class GrpoSection:
    rewards: list[RewardSpec] = _f(help="The reward functions each completion is scored by (weighted sum).")
    num_generations: int = _f(
        8, "Group size G: completions sampled per prompt, whose rewards are normalised within the group. Must divide "
        "the global batch (processes x per_device_train_batch_size x gradient_accumulation_steps).")
    loss_type: GrpoLoss = _f(
        "dapo", "How the per-token loss is averaged: grpo (each sequence's mean, averaged over the sequences), "
        "dr_grpo (sum over tokens / (sequences x max_completion_length)), dapo (sum over tokens / tokens); each over "
        "the optimizer step's global batch.")
    beta: float = _f(0.0, "KL coefficient to the reference model (0: none is built). The reference: with model.lora "
                     "the policy with the adapter disabled, else a frozen copy of the model.")
    num_iterations: int = _f(1, "Optimizer steps on each batch of completions (mu); > 1 makes the clipping bite.")
    epsilon: float | None = _f(
        None, "Clipping: the probability ratio to the policy that generated is kept within [1 - epsilon, "
        "1 + epsilon_high]; needs num_iterations > 1 (with one step per batch the ratio is 1); default 0.2.")
    epsilon_high: float | None = _f(None, "Upper clipping bound (DAPO's clip-higher, e.g. 0.28); default epsilon.")
    max_completion_length: int = _f(256, "Tokens generated at most per completion.")
    temperature: float = _f(1.0, "Sampling temperature of the generation.")
    top_p: float = _f(1.0, "Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all).")
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "Divide each advantage by the reward std of its group, of the batch, or not at all (Dr. GRPO).")
    reward_timeout: float = _f(
        60.0, "Seconds one call of a reward function (a batch of completions) may take; one that runs longer stops "
        "the run naming it, instead of leaving every rank waiting. 0: no limit.")
    tools: list[str] | None = _f(
        None, "Tools the model may call while it generates (multi-turn rollouts): `module:function` or "
        "`path/to/file.py:function`, each with type hints and a docstring (its JSON schema, as transformers reads "
        "it). A tool's output is in the context, never in the loss.")
    environment: str | None = _f(
        None, "An environment class (`module:Class` or `path/to/file.py:Class`; TRL's environment_factory, "
        "experimental there): one instance per rollout, reset(**row) before it (a text it returns is appended to the "
        "prompt), its public methods the model's tools, get_reward() (optional) a reward beside grpo.rewards. One "
        "that crashes ends the rollout with reward 0 (counted in tools/env_crashes), not the run.")
    max_tool_calls: int | None = _f(None, "Rounds of tool calls per rollout at most; past it the rollout is cut. "
                                    "Default: no limit but max_completion_length.")
    tool_timeout: float = _f(
        30.0, "Seconds one tool call may take; a call past it, or one that raises or returns no text, gives the model "
        "an error message (counted in tools/errors, tools/timeouts) instead of stopping the run. 0: no limit.")
    generation: Literal["transformers", "vllm"] = _f(
        "transformers", "Generate with transformers' generate(), or vLLM colocated on each GPU (needs vllm installed "
        "and a GPU; untested here).")
