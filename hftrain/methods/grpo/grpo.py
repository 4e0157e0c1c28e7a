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

import torch
from trl import GRPOConfig, GRPOTrainer

from ... import distributed
from ...config import HFTrainOptions, ModelSection, Recipe
from ...heads import Head, Role
from ...vision.families import head_of
from .prompts import PromptData, build_prompt_data, preview_prompts
from ...data.templates import template_kwargs
from ...errors import DataError, LaunchError, RewardError
from ...patches.transformers import mark_fsdp_managed
from .rewards import ModelReward, Policy, dry_run, load_rewards
from .user_code import CallCounts
from ...trainer import RUN_MIXINS
from .. import registry
from ..policy import load_policy, policy_peft_config
from ...evaluate import greedy_answer
from ..base import Method, ModelSpec
from ..modality import modality_of
from .grpo_section import RewardSpec
from ..sft import exact_match_metrics
from ..fused_head import FusedHeadMixin
from .environments import load_environment, shown_tools
from .tools import (ToolAnswer, load_tools, suffix_after_stop, tool_template_problem,
                    unanswered_calls)

EPSILON = 0.2  # TRL's (and the GRPO paper's) clipping range, grpo.epsilon unset
DEFAULT_TOOL_ROUNDS = 4  # rounds of tool calls in a held-out answer when grpo.max_tool_calls is unset


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
        max_tool_calling_iterations=g.max_tool_calls, use_vllm=g.generation == "vllm", vllm_mode="colocate",
        chat_template_kwargs=recipe.data.chat_template_kwargs,
        shuffle_dataset=recipe.typed_training.train_sampling_strategy != "sequential", disable_dropout=True,
        remove_unused_columns=False, model_init_kwargs={"revision": m.revision} if m.revision else None)


class GroupTrainer(*RUN_MIXINS, FusedHeadMixin, GRPOTrainer):
    """TRL's GRPOTrainer with hftrain's checkpoints, guards and compression; `reward_funcs` are rewards.Reward
    objects built with defer=True; `args` an HFGRPOConfig (grpo_config)."""

    def __init__(self, *args, tool_counts: CallCounts | None = None, **kwargs):
        left_padding(kwargs.get("processing_class"))
        super().__init__(*args, **kwargs)
        self.tool_counts = tool_counts or CallCounts()  # what the guarded tools (`tools`) count, logged per step
        # TRL renders prompts with args.chat_template_kwargs as given: hftrain's renderings also pin the date.
        self.chat_template_kwargs = template_kwargs(self._tokenizer, self.args.chat_template_kwargs)
        for reward in self._reward_models():  # once per rank, whole, on the policy's device
            reward.fn.load(self.accelerator.device, self.args)

    def _reward_models(self) -> list[ModelReward]:
        return [f for f in self.reward_funcs if isinstance(f, ModelReward)]

    def _get_tool_suffix_ids(self, tool_messages):
        """TRL's, less a first token the model stops at and has just generated (tools.suffix_after_stop): the
        rollout is the one whose turns end with `tool_messages` (TRL's loop passes that rollout's own message
        objects), its last generated token the last of its completion ids (TRL's loop updates them in place)."""
        completions, completion_ids = getattr(self, "_rollouts", ((), ()))
        last = next((ids[-1] for turns, ids in zip(completions, completion_ids)
                     if ids and turns and turns[-1] is tool_messages[-1]), None)
        return suffix_after_stop(super()._get_tool_suffix_ids(tool_messages), self.eos_token_ids, last)

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, *args):
        """TRL's, its rollouts seen by _get_tool_suffix_ids; the rollouts it leaves on a call it did not run are
        counted (tools/cut_rollouts)."""
        self._rollouts = (completions, completion_ids)
        try:
            out = super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, *args)
        finally:
            self._rollouts = ((), ())
        _, completions, *_ = out
        self.tool_counts.cut += unanswered_calls(completions)
        return out

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """super() shards the model; under FSDP2 generation must then run in lockstep (patches.transformers)."""
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.is_fsdp_enabled:
            mark_fsdp_managed(self.accelerator.unwrap_model(self.model_wrapped))
        return model, train_dataloader

    def _generate(self, prompts):
        """TRL's; the tool mask, and each rollout's tokens (prompt + completion, tools' answers included), kept for
        the rewards of the same rollouts (_calculate_rewards)."""
        out = super()._generate(prompts)
        self._tool_mask = out[2]
        self._rollout_ids = [list(p) + list(c) for p, c in zip(out[0], out[1])]  # what reward models read
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's (each rank scores its completions, then all-gathers), then every rank raises the first reward error
        of any rank: raised where it happened, it would leave the other ranks waiting in the all-gather. With tools,
        `completion_ids` are the tokens the model generated (TRL passes the tools' answers too: a length penalty
        would charge the model for what a tool said). A reward model reads the rollouts' own tokens (_generate)."""
        mask, self._tool_mask = getattr(self, "_tool_mask", None), None
        if mask is not None:
            completion_ids_list = [[t for t, m in zip(ids, keep) if m] for ids, keep in zip(completion_ids_list, mask)]
        rollout_ids, self._rollout_ids = getattr(self, "_rollout_ids", None), None
        for reward in self._reward_models():  # the tokens the policy generated from, scored when tokenizers agree
            reward.fn.rollout_ids = rollout_ids
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            for reward in self._reward_models():
                reward.fn.rollout_ids = None
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
        if self.tools:  # the tool calls of this generation batch, over every rank
            taken = self.tool_counts.take()
            total = self.accelerator.gather(torch.tensor(list(taken.values()), device=self.accelerator.device))
            total = dict(zip(taken, total.reshape(-1, len(taken)).sum(0).tolist()))
            self._metrics[mode]["tools/calls_per_rollout"].append(total["calls"] / max(advantages.numel(), 1))
            self._metrics[mode]["tools/errors"].append(total["errors"])
            self._metrics[mode]["tools/timeouts"].append(total["timeouts"])
            self._metrics[mode]["tools/cut_rollouts"].append(total["cut"])
            if self.environment_factories is not None:
                self._metrics[mode]["tools/env_crashes"].append(total["crashes"])
        return out


def left_padding(processing_class) -> None:
    """An image model's processor padding on the left, as TRL 1.16's GRPOTrainer pads the prompt ids: it builds the
    loss forward's image fields with the processor's own padding, so a right-padding tokenizer shifted the image
    token types of every shorter prompt of a batch (Qwen-VL's rope positions with them: 2 ranks x GA2 trained q/k
    15-35% apart from 1 x GA4, tests/test_vision_grpo.py). A tokenizer (text prompts) is TRL's to pad."""
    tokenizer = getattr(processing_class, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = "left"


def read_prompts(recipe: Recipe, tokenizer, world_size: int, seed: int) -> PromptData:
    """GRPO's data phase: every prompt read and checked, every reward function importable and answering the first
    prompts (their references and empty completions as the completions) with one number each, and one optimizer
    step's worth of prompts present. Nothing here loads the model."""
    g = recipe.grpo
    exact = next((f"grpo.rewards.{i} (exact_match)" for i, r in enumerate(g.rewards) if r.function == "exact_match"),
                 None)
    tools = shown_tools(g)  # importable, each with a JSON schema; the environment with reset and such methods
    problem = tools and tool_template_problem(tokenizer, template_kwargs(tokenizer, recipe.data.chat_template_kwargs))
    if problem:
        key = "grpo.tools" if g.tools else "grpo.environment"
        raise DataError(f"{key}: the chat template (data.chat_template, else the tokenizer's) {problem}")
    data = modality_of(recipe.model).read_prompts(  # text prompts by grpo/prompts.py, image prompts by vision/
        recipe, tokenizer, seed, lambda: build_prompt_data(recipe.data, tokenizer, g.max_completion_length, seed=seed,
                                                           exact_match=recipe.eval.exact_match, needs_reference=exact,
                                                           tools=tools),
        g.max_completion_length, exact)
    policy = Policy(tokenizer, recipe.data.chat_template_kwargs, data.conversational, recipe.model)
    dry_run(load_rewards(g, policy=policy), [data.train[i] for i in range(min(4, len(data.train)))], tokenizer,
            load_environment(g))
    values = recipe.typed_training
    per_step = (world_size * values.per_device_train_batch_size * values.gradient_accumulation_steps
                // g.num_generations)
    if len(data.train) < per_step:
        raise LaunchError(f"one optimizer step samples grpo.num_generations {g.num_generations} completions of each "
                          f"of {per_step} prompts and the data has {len(data.train)}: lower the batch or add prompts")
    distributed.print0(f"hftrain: {len(data.train)} training prompts" + (
        f", {len(data.eval_examples)} held out for exact match" if data.eval_examples else ""))
    return data


class GRPO(Method):
    """GRPO in the run: TRL's GRPOConfig, the policy (the reference is TRL's: the LoRA adapter disabled, or a frozen
    copy), the reward functions and GroupTrainer; judged by exact match of greedy answers to held-out prompts before
    and after, SFT's measure (sft.exact_match_metrics; no held-out loss: the Trainer gets no eval dataset)."""

    reported = ()

    def models(self, recipe):
        """The policy, and each reward model of grpo.rewards: held whole on every rank (each scores its own
        rollouts), with the policy's dtype, as RewardModel.load loads it; the plan and the fit check count them."""
        head = head_of(recipe.model)  # a causal LM, or an image-text-to-text model (modality.py)
        out = [ModelSpec(Role.POLICY, head, recipe.model)]
        if getattr(recipe.grpo, "beta", 0) and recipe.model.lora is None:  # TRL's frozen copy for the KL term
            out.append(ModelSpec(Role.REFERENCE, head, recipe.model, key="model"))
        rewards = recipe.grpo.rewards if isinstance(getattr(recipe.grpo, "rewards", None), list) else []
        for i, r in enumerate(rewards):
            if isinstance(r, RewardSpec) and isinstance(r.model, str) and r.model:
                process = r.aggregate is not None
                section = ModelSection(name_or_path=r.model, dtype=recipe.model.dtype, kernels="none",
                                       trust_remote_code=recipe.model.trust_remote_code)
                head = Head.TOKEN_CLASSIFICATION if process else Head.SEQUENCE_CLASSIFICATION
                out.append(ModelSpec(Role.REWARD, head, section, key=f"grpo.rewards.{i}.model",
                                     num_labels=2 if process else 1, whole=True))
        return out

    def model(self, run):
        policy = self.policy(run.recipe)
        return modality_of(policy.section).prepare(load_policy(policy.section, policy.head), run.recipe, False)

    def metrics(self, run, trainer, data, before):
        """Exact match as SFT's; with grpo.tools, answers over several turns calling them (tools.ToolAnswer)."""
        g = run.recipe.grpo
        answer = ToolAnswer(load_tools(g), g.max_tool_calls or DEFAULT_TOOL_ROUNDS) if g.tools else greedy_answer
        return exact_match_metrics(run, trainer, data, before, answer)

    def describe(self, recipe):
        g = recipe.grpo
        rewards = ", ".join(str(r.function or f"model {r.model}") for r in g.rewards or [])
        return f"GRPO ({g.loss_type} loss, groups of {g.num_generations}, beta={g.beta}, rewards: {rewards})"

    def trainer(self, run, model, tokenizer, data, callbacks):
        counts = CallCounts()
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train,
                                  processing_class=getattr(data, "processor", None) or tokenizer,  # saved beside it
                                  reward_funcs=load_rewards(run.recipe.grpo, defer=True, policy=Policy(
                                      tokenizer, run.recipe.data.chat_template_kwargs, data.conversational,
                                      run.recipe.model)),
                                  tools=load_tools(run.recipe.grpo, counts) or None, tool_counts=counts,
                                  environment_factory=load_environment(run.recipe.grpo, counts),
                                  peft_config=policy_peft_config(run.recipe.model, self.policy(run.recipe).head),
                                  callbacks=callbacks)


def show_prompts(recipe: Recipe, tokenizer, n: int) -> str:
    """What `hftrain data` prints: the prompts as the policy receives them (text by grpo/prompts.py, with the tools
    it shows; prompts with images by vision/)."""
    g = recipe.grpo
    return modality_of(recipe.model).show_prompts(
        recipe, tokenizer, n, lambda: preview_prompts(recipe.data, tokenizer, g.max_completion_length, n,
                                                      shown_tools(g)), g.max_completion_length)


METHOD = GRPO(
    entry=registry.GRPO, read=read_prompts, unit="prompts", counts_its_steps=True, show=show_prompts,
    arguments=grpo_config, trainer_class=GroupTrainer, modalities=("text", "images"))
