"""The `grpo:` section of a recipe (hftrain grpo: grpo.py, rewards.py, tools.py and environments.py read it) and
its rules: the section's values and reward functions, what the rest of a GRPO recipe may not ask for, where it runs,
and at launch whether the group size divides the global batch and whether vLLM can generate here. config builds it as
a field of methods.Recipe and asks it for its rules (config.MethodSection)."""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from typing import Literal

from ...config import DataSource, LoraSection, MethodSection, Problems, Recipe, option
from ...config.fields import is_number as _num
from ...distributed import accelerator_available
from ..policy import policy_strategy_problems, sft_only_problems
from ..reward_model import ProcessOptions, reward_model_problems

GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]
BUILTIN_REWARDS = ("exact_match", "regex", "length_penalty")


@dataclass
class RewardSpec:
    function: str | None = option(
        None, "exact_match (1 when the completion equals the reference answer, whitespace-stripped), regex (1 when the "
        "whole completion matches `pattern`), length_penalty (-tokens beyond `limit` / grpo.max_completion_length), "
        "or your own as module:function or path/to/file.py:function, called as fn(prompts, completions, reference, "
        "**kwargs) and returning one number (or None: does not apply) per completion. Or `model` instead.")
    model: str | None = option(
        None, "A trained reward model instead of a function: the folder (or Hub id) of a sequence classifier with one "
        "label (what AutoModelForSequenceClassification saves, e.g. an outcome reward model), scoring prompt + "
        "completion, loaded once per rank without gradients (docs/grpo.md: the text it reads, its pad token).")
    aggregate: Literal["min", "last"] | None = option(
        None, "A process reward model (`model` a token classifier with two labels, as hftrain reward with kind "
        "process trains it) scores each step; the completion's reward is min (its weakest step) or last (its last "
        "step's score). Required for such a model, refused for any other.")
    step_separator: str | None = option(
        None, "A process reward model: the text that ends each step, as it was trained; default: reward."
        "step_separator of the recipe.yaml its training run wrote beside the weights.")
    weight: float = option(1.0, "Weight of this reward in the sum that scores each completion.")
    pattern: str | None = option(
        None, "regex: the pattern the whole completion must match (Python re.fullmatch, DOTALL).")
    limit: int | None = option(None, "length_penalty: completion tokens that cost nothing; default 0.")


@dataclass
class GrpoSection(MethodSection):
    HELP = "Online RL with verifiable rewards (recipes/grpo.py): rewards, group size, loss, generation."

    rewards: list[RewardSpec] = option(help="The reward functions each completion is scored by (weighted sum).")
    num_generations: int = option(
        8, "Group size G: completions sampled per prompt, whose rewards are normalised within the group. Must divide "
        "the global batch (processes x per_device_train_batch_size x gradient_accumulation_steps).")
    loss_type: GrpoLoss = option(
        "dapo", "How the per-token loss is averaged: grpo (each sequence's mean, averaged over the sequences), "
        "dr_grpo (sum over tokens / (sequences x max_completion_length)), dapo (sum over tokens / tokens); each over "
        "the optimizer step's global batch.")
    beta: float = option(
        0.0, "KL coefficient to the reference model (0: none is built). The reference: with model.lora "
        "the policy with the adapter disabled, else a frozen copy of the model.")
    num_iterations: int = option(1, "Optimizer steps on each batch of completions (mu); > 1 makes the clipping bite.")
    epsilon: float | None = option(
        None, "Clipping: the probability ratio to the policy that generated is kept within [1 - epsilon, "
        "1 + epsilon_high]; needs num_iterations > 1 (with one step per batch the ratio is 1); default 0.2.")
    epsilon_high: float | None = option(None, "Upper clipping bound (DAPO's clip-higher, e.g. 0.28); default epsilon.")
    max_completion_length: int = option(256, "Tokens generated at most per completion.")
    temperature: float = option(1.0, "Sampling temperature of the generation.")
    top_p: float = option(1.0, "Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all).")
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "Divide each advantage by the reward std of its group, of the batch, or not at all (Dr. GRPO).")
    reward_timeout: float = option(
        60.0, "Seconds one call of a reward function (a batch of completions) may take; one that runs longer stops "
        "the run naming it, instead of leaving every rank waiting (a call stuck in C code ends its rank 5 s later, "
        "named: docs/grpo.md). 0: no limit.")
    tools: list[str] | None = option(
        None, "Tools the model may call while it generates (multi-turn rollouts): `module:function` or "
        "`path/to/file.py:function`, each with type hints and a docstring (its JSON schema, as transformers reads "
        "it). A tool's output is in the context, never in the loss.")
    environment: str | None = option(
        None, "An environment class (`module:Class` or `path/to/file.py:Class`; TRL's environment_factory, "
        "experimental there): one instance per rollout, reset(**row) before it (a text it returns is appended to the "
        "prompt), its public methods the model's tools, get_reward() (optional) a reward beside grpo.rewards. One "
        "that crashes ends the rollout with reward 0 (counted in tools/env_crashes), not the run.")
    max_tool_calls: int | None = option(None, "Rounds of tool calls per rollout at most; past it the rollout is cut. "
                                        "Default: no limit but max_completion_length.")
    tool_timeout: float = option(
        30.0, "Seconds one tool call may take; a call past it, or one that raises or returns no text, gives the model "
        "an error message (counted in tools/errors, tools/timeouts; an environment's methods alike) instead of "
        "stopping the run (a call stuck in C code ends its rank 5 s later, named: docs/grpo.md). 0: no limit.")
    generation: Literal["transformers", "vllm"] = option(
        "transformers", "Generate with transformers' generate(), or vLLM colocated on each GPU (needs vllm installed "
        "and a GPU; untested here).")

    @property
    def method(self) -> str:
        """The method this section selects (registry.METHODS)."""
        return "grpo"

    def problems(self, recipe: Recipe) -> Problems:
        return grpo_problems(recipe)

    def strategy_problems(self, recipe: Recipe, strategy: str) -> Problems:
        return policy_strategy_problems(recipe, strategy, "GRPO", whole="its rollouts are generated and scored "
                                        "whole on each rank: nothing would split them")

    def launch_problems(self, recipe: Recipe, world: int, environment: bool) -> Problems:
        return launch_problems(recipe, world, environment)


def grpo_problems(recipe: Recipe) -> Problems:
    """Rules of the `grpo:` section, and what the rest of a GRPO recipe may not ask for. Whether the group size
    divides the global batch needs the number of processes: `launch_problems`."""
    # data.truncation is left to GRPO (drop: too-long prompts are dropped)
    return (_section_problems(recipe.grpo) + _data_problems(recipe) + _other_section_problems(recipe)
            + sft_only_problems(recipe, "GRPO", rows="GRPO (it trains on the completions it samples)",
                                averaged="GRPO averages as grpo.loss_type says"))


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
    if recipe.typed_training.eval_strategy not in ("no", None):
        out.append(("training.eval_strategy", "GRPO is judged by eval.exact_match on held-out prompts before and "
                    "after training (greedy answers); remove eval_strategy"))
    if "include_num_input_tokens_seen" in recipe.training:
        out.append(("training.include_num_input_tokens_seen", "GRPO's batches are prompts the Trainer cannot count: "
                    "TRL counts prompt and completion tokens itself (num_tokens in the logs); remove it"))
    if recipe.typed_training.train_sampling_strategy not in ("random", "sequential"):
        out.append(("training.train_sampling_strategy", "GRPO samples prompts in groups (TRL's RepeatSampler): "
                    "random (shuffled) or sequential, not "
                    f"{recipe.typed_training.train_sampling_strategy!r}"))
    lora = recipe.model.lora if recipe.model is not None else None
    if isinstance(lora, LoraSection) and lora.reaches("lm_head"):
        out.append(("model.lora", "GRPO computes log-probs from lm_head's weight directly, so an adapter on lm_head "
                    "would never train: leave lm_head out of target_modules and modules_to_save"))
    return out


def _reward_problems(r: RewardSpec, key: str) -> Problems:
    out: Problems = []
    fn = r.function
    if (fn is None) == (r.model is None):
        out.append((key, "needs exactly one of `function` (a built-in or your own) and `model` (a reward model's "
                    f"folder), got {'both' if fn is not None else 'neither'}"))
    if isinstance(fn, str) and fn not in BUILTIN_REWARDS:
        module, _, name = fn.rpartition(":")
        if not module or not name.isidentifier():
            out.append((f"{key}.function", f"'{fn}' is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
                        "module:function (or path/to/file.py:function) of your own"))
    what = f"'{fn}'" if fn is not None else "a reward model"
    if r.pattern is not None and fn != "regex":
        out.append((f"{key}.pattern", f"applies to function regex, not {what}: remove it"))
    if fn == "regex" and r.pattern is None:
        out.append((f"{key}.pattern", "function regex needs the pattern a completion must match, e.g. "
                    "pattern: '<answer>.*</answer>'"))
    if isinstance(r.pattern, str):
        try:
            re.compile(r.pattern)
        except re.error as e:
            out.append((f"{key}.pattern", f"is not a regular expression: {e}"))
    for option_name in ("aggregate", "step_separator"):
        if getattr(r, option_name) is not None and r.model is None:
            out.append((f"{key}.{option_name}", f"applies to a process reward model (`model`), not {what}: remove it"))
    if r.step_separator is not None and (not isinstance(r.step_separator, str) or not r.step_separator):
        out.append((f"{key}.step_separator", f"must be non-empty text, got {r.step_separator!r}"))
    if r.limit is not None and fn != "length_penalty":
        out.append((f"{key}.limit", f"applies to function length_penalty, not {what}: remove it"))
    if _num(r.limit) and r.limit < 0:
        out.append((f"{key}.limit", f"must be >= 0, got {r.limit}"))
    if _num(r.weight) and not math.isfinite(r.weight):
        out.append((f"{key}.weight", f"must be a finite number, got {r.weight}"))
    return out


def grpo_batch_problem(recipe: Recipe, world: int) -> tuple[str, str] | None:
    """GRPO samples grpo.num_generations completions of each prompt within one optimizer step's global batch:
    the group size must divide processes x per_device_train_batch_size x gradient_accumulation_steps."""
    g = recipe.grpo
    values = recipe.typed_training
    per_device, accumulation = values.per_device_train_batch_size, values.gradient_accumulation_steps
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


def launch_problems(recipe: Recipe, world: int, environment: bool) -> Problems:
    """What the launch decides: the group size against the global batch of `world` processes (unless a training:
    value it needs is already wrong), and, on the machine that runs, whether vLLM can generate and whether each
    reward model is a sequence classifier with one label, or a process reward model with aggregate and its separator
    (its config.json and recipe.yaml: reward_model.reward_model_problems)."""
    out: Problems = []
    batch = None if any(k.startswith("training.") for k in recipe.invalid) else grpo_batch_problem(recipe, world)
    if batch:
        out.append(batch)
    if environment and recipe.grpo.generation == "vllm":
        out += [("grpo.generation", msg) for msg in vllm_problems()]
    for i, r in enumerate(recipe.grpo.rewards if environment and isinstance(recipe.grpo.rewards, list) else []):
        if isinstance(r, RewardSpec) and isinstance(r.model, str) and f"grpo.rewards.{i}.model" not in recipe.invalid:
            out += reward_model_problems(r.model, f"grpo.rewards.{i}.model",
                                         ProcessOptions(r.aggregate, r.step_separator))
    return out


def vllm_problems() -> list[str]:
    """grpo.generation: vllm runs TRL's colocated vLLM engine: it needs the vllm package and a GPU."""
    out = []
    if importlib.util.find_spec("vllm") is None:
        out.append("vllm is not installed here: `pip install vllm` (a version TRL supports), or use generation: "
                   "transformers")
    if not accelerator_available():
        out.append("vllm generates on a GPU and there is none on this machine: use generation: transformers")
    return out
