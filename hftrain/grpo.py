"""GRPO (online RL with verifiable rewards): TRL's GRPOTrainer with hftrain's run mixins (staged checkpoints, guards,
compression; trainer/), configured from the recipe's `grpo:` section.

TRL 1.16 does the method: the generation batch (each prompt's group of grpo.num_generations completions within one
optimizer step, spread over the ranks by its RepeatSampler), generation (transformers, or vLLM), rewards gathered
from every rank and normalised per group, the clipped loss with the KL to the reference (with LoRA the adapter
disabled, else a frozen copy), and its metrics (reward mean/std per function, KL, clip ratios, completion lengths).
Its three length normalisations are exact across world size and accumulation when the generation batch is one
optimizer step (steps_per_generation = gradient_accumulation_steps, TRL's default, kept here; tests/test_grpo_runs.py
checks 1 rank x GA4 against 2 ranks x GA2 under each strategy):

    grpo     mean over sequences of each sequence's token mean: every micro-batch holds per_device_train_batch_size
             sequences, so the mean of micro-batch means over accumulation and ranks is the global mean;
    dr_grpo  token sum / (sequences x max_completion_length): the same argument;
    dapo     token sum / the generation batch's token count, all-reduced over the ranks (the global count, as hftrain
             does for SFT).

TRL's `bnpo` (each micro-batch's own token mean, a mean of means) is not offered: it changes with the world size and
accumulation (the same test shows it). Written here, what TRL lacks: reward functions checked and their errors raised
on every rank at once (rewards.py), generation in lockstep under FSDP2 (patches/transformers.py), the advantages'
spread in the logs, and the policy's chat_template_kwargs with hftrain's pinned date (data/templates.py).
"""

from __future__ import annotations

import dataclasses

from trl import GRPOConfig, GRPOTrainer

from . import distributed
from .config import HFTrainOptions, ModelSection, Recipe
from .data.templates import template_kwargs
from .errors import RewardError
from .modeling import load_model, lora_config
from .patches.transformers import mark_fsdp_managed
from .trainer import RUN_MIXINS

EPSILON = 0.2  # TRL's (and the GRPO paper's) clipping range, grpo.epsilon unset


@dataclasses.dataclass
class HFGRPOConfig(GRPOConfig, HFTrainOptions):
    """TRL's GRPOConfig with hftrain's options."""


def grpo_config(recipe: Recipe, **kwargs) -> HFGRPOConfig:
    """The run's arguments (`kwargs`: every TrainingArguments value launch.setup resolved) plus the grpo section's.
    TRL's configs default bf16 to true and the learning rate to 1e-6: a recipe's `training:` means TrainingArguments'
    values here as for SFT. There is no evaluation dataset (GRPO is judged by eval.exact_match), so no eval_on_start;
    the Trainer cannot count tokens in GRPO's batches of prompts (TRL counts prompt and completion tokens itself)."""
    g, m = recipe.grpo, recipe.model
    for name in ("bf16", "learning_rate"):
        kwargs.setdefault(name, recipe.training_value(name))
    kwargs.update(eval_on_start=False, include_num_input_tokens_seen="no")
    return HFGRPOConfig(
        **kwargs, num_generations=g.num_generations, loss_type=g.loss_type, beta=g.beta,
        num_iterations=g.num_iterations, epsilon=EPSILON if g.epsilon is None else g.epsilon,
        epsilon_high=g.epsilon_high, max_completion_length=g.max_completion_length, temperature=g.temperature,
        top_p=g.top_p, scale_rewards=g.scale_rewards, reward_weights=[r.weight for r in g.rewards],
        use_vllm=g.generation == "vllm", vllm_mode="colocate", chat_template_kwargs=recipe.data.chat_template_kwargs,
        shuffle_dataset=recipe.training_value("train_sampling_strategy") != "sequential", disable_dropout=True,
        remove_unused_columns=False, model_init_kwargs={"revision": m.revision} if m.revision else None)


def load_policy(cfg: ModelSection):
    """The model to tune; with model.lora the base model, which TRL wraps with `policy_peft_config` and uses, the fresh
    adapter disabled, as the reference (no copy). As preference.load_policy (a sibling layer: not imported)."""
    return load_model(cfg if cfg.lora is None else dataclasses.replace(cfg, lora=None))


def policy_peft_config(cfg: ModelSection):
    return lora_config(cfg) if cfg.lora is not None else None


class GroupTrainer(*RUN_MIXINS, GRPOTrainer):
    """TRL's GRPOTrainer with hftrain's checkpoints, guards and compression; `reward_funcs` are rewards.Reward
    objects built with defer=True; `args` an HFGRPOConfig (grpo_config)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TRL renders prompts with args.chat_template_kwargs as given: hftrain's renderings also pin the date.
        self.chat_template_kwargs = template_kwargs(self._tokenizer, self.args.chat_template_kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """super() shards the model; under FSDP2 generation must then run in lockstep (patches.transformers)."""
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.is_fsdp_enabled:
            mark_fsdp_managed(self.accelerator.unwrap_model(self.model_wrapped))
        return model, train_dataloader

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's (each rank scores its completions, then all-gathers), then every rank raises the first reward error
        of any rank: raised where it happened, it would leave the other ranks waiting in the all-gather."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mine = next((f.error for f in self.reward_funcs if getattr(f, "error", None)), None)
        errors = distributed.all_gather_object(mine) if self.args.world_size > 1 else [mine]
        first = next((e for e in errors if e), None)
        if first:
            raise RewardError(first)
        return rewards

    def _generate_and_score_completions(self, inputs):
        """TRL's, and the spread of the advantages over the global batch in the logs (advantages/abs_mean, /std)."""
        out = super()._generate_and_score_completions(inputs)
        advantages = self.accelerator.gather(out["advantages"].detach()).float()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["advantages/abs_mean"].append(advantages.abs().mean().item())
        self._metrics[mode]["advantages/std"].append(advantages.std().item() if advantages.numel() > 1 else 0.0)
        return out
