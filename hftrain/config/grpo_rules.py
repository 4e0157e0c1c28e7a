"""Rules of a GRPO recipe: the `grpo:` section, its reward functions, what the rest of the recipe may not ask for,
and whether the group size divides the global batch (which needs the number of processes: launch.preflight)."""

from __future__ import annotations

import math
import re

from .fields import is_number
from .sections import (
    BUILTIN_REWARDS,
    DataSource,
    GrpoSection,
    LoraSection,
    Recipe,
    RewardSpec,
)

Problems = list[tuple[str, str]]
GRPO_STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")  # where its exactness is tested (tests/test_grpo_runs.py)
# data: options of supervised fine-tuning that mean nothing to GRPO, which trains on the completions it samples
# (data.truncation: drop does: it drops too-long prompts).
_SFT_ONLY_DATA = {"packing": False, "assistant_only_loss": True, "completion_only_loss": True,
                  "skip_untrainable": False, "train_turns": "all"}


_num = is_number


def grpo_problems(recipe: Recipe) -> Problems:
    """Rules of the `grpo:` section, and what the rest of a GRPO recipe may not ask for. Whether the group size
    divides the global batch needs the number of processes: `grpo_batch_problem`."""
    out: Problems = []
    if recipe.preference is not None:
        out.append(("grpo", "a recipe trains one method: remove the preference: section (recipes/dpo.py) or this one"))
    return out + _section_problems(recipe.grpo) + _data_problems(recipe) + _other_section_problems(recipe)


def _section_problems(g) -> Problems:
    """The grpo: section's own values."""
    out: Problems = []
    if _num(g.num_generations) and g.num_generations < 2:
        out.append(("grpo.num_generations", f"must be at least 2 (advantages compare completions of one prompt), "
                    f"got {g.num_generations}"))
    if _num(g.beta) and not (math.isfinite(g.beta) and g.beta >= 0):
        out.append(("grpo.beta", f"must be a finite number >= 0, got {g.beta}"))
    if _num(g.num_iterations) and g.num_iterations < 1:
        out.append(("grpo.num_iterations", f"must be at least 1, got {g.num_iterations}"))
    for key in ("epsilon", "epsilon_high"):
        v = getattr(g, key)
        if _num(v) and not (math.isfinite(v) and 0 < v < (1 if key == "epsilon" else math.inf)):
            out.append((f"grpo.{key}", f"must be a finite number in (0, {1 if key == 'epsilon' else 'inf'}), got {v}"))
        if v is not None and g.num_iterations == 1:
            out.append((f"grpo.{key}", "clips the probability ratio to the policy that generated, which is 1 with "
                        "one optimizer step per batch of completions: set grpo.num_iterations > 1, or remove it"))
    if _num(g.max_completion_length) and g.max_completion_length < 1:
        out.append(("grpo.max_completion_length", f"must be at least 1, got {g.max_completion_length}"))
    if _num(g.temperature) and not (math.isfinite(g.temperature) and g.temperature > 0):
        out.append(("grpo.temperature", f"must be a finite number > 0, got {g.temperature}"))
    if _num(g.top_p) and not 0 < g.top_p <= 1:
        out.append(("grpo.top_p", f"must be in (0, 1], got {g.top_p}"))
    if _num(g.reward_timeout) and not (math.isfinite(g.reward_timeout) and g.reward_timeout >= 0):
        out.append(("grpo.reward_timeout", f"must be a finite number of seconds >= 0 (0: no limit), got "
                    f"{g.reward_timeout}"))
    if _num(g.max_tool_calls) and g.max_tool_calls < 1:
        out.append(("grpo.max_tool_calls", f"must be at least 1 (unset: no limit), got {g.max_tool_calls}"))
    if _num(g.tool_timeout) and not (math.isfinite(g.tool_timeout) and g.tool_timeout >= 0):
        out.append(("grpo.tool_timeout", f"must be a finite number of seconds >= 0 (0: no limit), got "
                    f"{g.tool_timeout}"))
    for i, spec in enumerate(g.tools if isinstance(g.tools, list) else []):
        module, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
        if isinstance(spec, str) and (not module or not name.isidentifier()):
            out.append((f"grpo.tools.{i}", f"{spec!r} is not module:function (or path/to/file.py:function) of "
                        "your own"))
    if isinstance(g.environment, str) and not (g.environment.rpartition(":")[0]
                                               and g.environment.rpartition(":")[2].isidentifier()):
        out.append(("grpo.environment", f"{g.environment!r} is not module:Class (or path/to/file.py:Class) of your "
                    "own"))
    if g.max_tool_calls is not None and not g.tools and not g.environment:
        out.append(("grpo.max_tool_calls", "limits tool calls, and neither grpo.tools nor grpo.environment gives the "
                    "model any: add tools, or remove it"))
    if isinstance(g.rewards, list) and not g.rewards and not g.environment:
        out.append(("grpo.rewards", "needs at least one reward function, e.g. [{function: exact_match}] (or an "
                    "environment with a get_reward method: grpo.environment)"))
    for i, r in enumerate(g.rewards if isinstance(g.rewards, list) else []):
        if isinstance(r, RewardSpec):
            out += _reward_problems(r, f"grpo.rewards.{i}")
    return out


def _data_problems(recipe: Recipe) -> Problems:
    """The data: section's keys that bound or shape what GRPO samples from."""
    g, d, out = recipe.grpo, recipe.data, []
    if d is None:
        return out
    if _num(d.max_length) and _num(g.max_completion_length) and d.max_length <= g.max_completion_length:
        out.append(("data.max_length", f"bounds prompt + completion and must exceed grpo.max_completion_length "
                    f"({g.max_completion_length}), got {d.max_length}"))
    for key, unset in _SFT_ONLY_DATA.items():
        if getattr(d, key) != unset:
            out.append((f"data.{key}", "applies to supervised fine-tuning, not to GRPO (it trains on the "
                        "completions it samples): remove it"))
    for group in ("sources", "eval_sources"):
        for i, s in enumerate(getattr(d, group) if isinstance(getattr(d, group), list) else []):
            if isinstance(s, DataSource) and s.format == "text":
                out.append((f"data.{group}.{i}.format", "text rows hold no prompt to answer: GRPO reads messages, "
                            "sharegpt, alpaca or prompt_completion rows (the prompt, and the reference answer)"))
    return out


def _other_section_problems(recipe: Recipe) -> Problems:
    """training:, eval:, model.lora and moe: keys that do not apply to GRPO."""
    out: Problems = []
    if recipe.grpo.environment and recipe.eval is not None and recipe.eval.exact_match:
        out.append(("eval.exact_match", "held-out answers with grpo.environment need each row's environment, which "
                    "the evaluation does not run: set eval.exact_match: 0 (the environment's reward is logged per "
                    "step as rewards/<Class>/mean)"))
    if recipe.training.get("loss_averaging") not in ("token", None):
        out.append(("training.loss_averaging", "applies to the CE of supervised fine-tuning; GRPO averages as "
                    "grpo.loss_type says: remove it"))
    if recipe.training.get("loss_impl") == "chunked":
        out.append(("training.loss_impl", "applies to supervised fine-tuning (TRL computes GRPO's log-probs with "
                    "its own fused head): remove it"))
    if recipe.training_value("eval_strategy") not in ("no", None):
        out.append(("training.eval_strategy", "GRPO is judged by eval.exact_match on held-out prompts before and "
                    "after training (greedy answers); remove eval_strategy"))
    if "include_num_input_tokens_seen" in recipe.training:
        out.append(("training.include_num_input_tokens_seen", "GRPO's batches are prompts the Trainer cannot count: "
                    "TRL counts prompt and completion tokens itself (num_tokens in the logs); remove it"))
    if recipe.training_value("train_sampling_strategy") not in ("random", "sequential"):
        out.append(("training.train_sampling_strategy", "GRPO samples prompts in groups (TRL's RepeatSampler): "
                    "random (shuffled) or sequential, not "
                    f"{recipe.training_value('train_sampling_strategy')!r}"))
    lora = recipe.model.lora if recipe.model is not None else None
    if isinstance(lora, LoraSection) and any(isinstance(v, list) and "lm_head" in v
                                             for v in (lora.target_modules, lora.modules_to_save)):
        out.append(("model.lora", "GRPO computes log-probs from lm_head's weight directly, so an adapter on lm_head "
                    "would never train: leave lm_head out of target_modules and modules_to_save"))
    if recipe.moe is not None:
        out.append(("moe", "is not supported with GRPO: train the MoE model with recipes/sft.py"))
    return out


def _reward_problems(r: RewardSpec, key: str) -> Problems:
    out: Problems = []
    fn = r.function
    if isinstance(fn, str) and fn not in BUILTIN_REWARDS:
        module, _, name = fn.rpartition(":")
        if not module or not name.isidentifier():
            out.append((f"{key}.function", f"'{fn}' is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
                        "module:function (or path/to/file.py:function) of your own"))
    if r.pattern is not None and fn != "regex":
        out.append((f"{key}.pattern", f"applies to function regex, not '{fn}': remove it"))
    if fn == "regex" and r.pattern is None:
        out.append((f"{key}.pattern", "function regex needs the pattern a completion must match, e.g. "
                    "pattern: '<answer>.*</answer>'"))
    if isinstance(r.pattern, str):
        try:
            re.compile(r.pattern)
        except re.error as e:
            out.append((f"{key}.pattern", f"is not a regular expression: {e}"))
    if r.limit is not None and fn != "length_penalty":
        out.append((f"{key}.limit", f"applies to function length_penalty, not '{fn}': remove it"))
    if _num(r.limit) and r.limit < 0:
        out.append((f"{key}.limit", f"must be >= 0, got {r.limit}"))
    if _num(r.weight) and not math.isfinite(r.weight):
        out.append((f"{key}.weight", f"must be a finite number, got {r.weight}"))
    return out


def grpo_batch_problem(recipe: Recipe, world: int) -> tuple[str, str] | None:
    """GRPO samples grpo.num_generations completions of each prompt within one optimizer step's global batch:
    the group size must divide processes x per_device_train_batch_size x gradient_accumulation_steps."""
    g = recipe.grpo
    per_device, accumulation = (recipe.training_value(k) for k in ("per_device_train_batch_size",
                                                                    "gradient_accumulation_steps"))
    if not (isinstance(g, GrpoSection) and all(_num(v) and v > 0 for v in (g.num_generations, per_device,
                                                                           accumulation))):
        return None
    batch = world * per_device * accumulation
    if batch % g.num_generations:
        fits = [n for n in range(2, batch + 1) if batch % n == 0]
        return ("grpo.num_generations", f"{g.num_generations} does not divide the global batch of {batch} "
                f"completions ({world} processes x per_device_train_batch_size {per_device} x "
                f"gradient_accumulation_steps {accumulation}): every prompt's group must be whole within one step; "
                f"use a group size among {fits[:8]} or change the batch")
    return None
