"""GRPO's reward functions: the built-ins a recipe names, the user's own, and the checks that turn a bad one into one
clear error naming it (errors.RewardError, exit 2) rather than a traceback or a NaN advantage.

    exact_match     1 when the completion equals the row's reference answer (both whitespace-stripped), else 0
    regex           1 when the whole completion matches `pattern` (re.fullmatch, DOTALL), else 0
    length_penalty  -(completion tokens beyond `limit`) / grpo.max_completion_length
    module:function or path/to/file.py:function: your own
    model: a trained reward model's folder (reward_model.py: its score of prompt + completion)

Each is called as TRL's GRPOTrainer 1.16 calls reward functions: fn(prompts, completions, completion_ids, reference,
trainer_state, log_extra, log_metric), with completions as text, or as [{"role": "assistant", "content": ...}] for
conversation prompts; it returns one number per completion (None: does not apply). Why hftrain checks: TRL checks
only the length (a bare ValueError), turns None into NaN and hands anything else to torch.tensor, and a function that
raises on one rank leaves the others waiting in the rewards' all-gather. Here each call runs in the user-code guard
(user_code.call_user_code: copies of the data, prints on stderr, grpo.reward_timeout), and a function that raises,
exits, returns the wrong number of values or a non-number, or runs past its limit is reported with its name, and
(`defer`) the error is held until after the all-gather, where every rank raises it (GroupTrainer). A function stuck
in C code past the limit ends the rank, named, by the guard's watchdog. `dry_run` calls every function on the data
before the model loads, so what can be caught before any weight moves is.
"""

from __future__ import annotations

import math
import os
import re

from dataclasses import dataclass

from ...config import ModelSection
from .grpo_section import GrpoSection, RewardSpec
from ...errors import RewardError
from ..process_reward_model import ProcessRewardModel
from ..reward_model import RewardModel, model_folder, text_of, trained_separator
from .user_code import UserCodeFailure, call_user_code, import_function, limit_of


def exact_match(prompts, completions, reference, **_):
    return [None if ref is None else float(text_of(c).strip() == ref.strip()) for c, ref in zip(completions, reference)]


def _regex(pattern: str):
    compiled = re.compile(pattern, re.DOTALL)

    def regex(prompts, completions, **_):
        return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]

    return regex


def _length_penalty(limit: int, max_completion_length: int):
    def length_penalty(prompts, completions, completion_ids, **_):
        return [-max(0, len(ids) - limit) / max_completion_length for ids in completion_ids]

    return length_penalty


# What TRL hands a reward function that is not data: the trainer's state, its loggers, the environments. Everything
# else (prompts, completions, completion_ids, the rows' columns) is copied for each function.
NOT_COPIED = ("trainer_state", "log_extra", "log_metric", "environments")


class Reward:
    """One reward function as TRL calls it, on copies of its inputs, within `timeout` seconds, its prints on stderr,
    its result checked. `defer`: an error is kept in `error` (and None returned for every completion) instead of
    raised, for the caller to raise on every rank at once."""

    def __init__(self, fn, name: str, key: str, defer: bool = False, timeout: float | None = None):
        self.fn, self.__name__, self.key, self.defer, self.error = fn, name, key, defer, None
        self.limit = limit_of(timeout, "grpo.reward_timeout")

    def __call__(self, prompts, completions, **kwargs):
        n = len(completions)
        try:
            return self._checked(self._call(prompts, completions, kwargs), n)
        except RewardError as e:
            if not self.defer:
                raise
            self.error = self.error or str(e)
            return [None] * n

    def _call(self, prompts, completions, kwargs: dict):
        what = f"{self.key} ({self.__name__})"
        data = {"prompts": prompts, "completions": completions,
                **{k: v for k, v in kwargs.items() if k not in NOT_COPIED}}
        try:
            return call_user_code(self.fn, what, kwargs=data, limit=self.limit,
                                  shared={k: v for k, v in kwargs.items() if k in NOT_COPIED})
        except UserCodeFailure as e:
            if e.timed_out:
                raise RewardError(f"{what} did not return within {self.limit} (for {len(completions)} "
                                  f"completions); make it faster, or raise {self.limit.key} (0: no limit)") from None
            fix = "; return a list of numbers instead" if e.exited else ""
            raise RewardError(f"{what} {e.reason}{e.place}{fix}") from None

    def _checked(self, values, n: int) -> list:
        what = f"{self.key} ({self.__name__})"
        if not isinstance(values, (list, tuple)):
            raise RewardError(f"{what} returned {type(values).__name__} {str(values)[:60]!r}; return a list of one "
                              f"number per completion ({n})")
        if len(values) != n:
            raise RewardError(f"{what} returned {len(values)} values for {n} completions; return one number per "
                              "completion")
        out = []
        for i, v in enumerate(values):
            if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # a 0-d tensor or a numpy scalar
                v = v.item()
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise RewardError(f"{what} returned {v!r} ({type(v).__name__}) for completion {i}; each value must "
                                  "be a finite number, or None where the function does not apply")
            out.append(None if v is None else float(v))
        return out


class ModelReward(Reward):
    """A reward model (reward_model.RewardModel) as a reward: hftrain's own code, called directly (not in the
    user-code guard, whose time limit is for the user's functions), its values checked and its errors deferred as
    any reward's."""

    def _call(self, prompts, completions, kwargs: dict):
        return self.fn(prompts, completions, **kwargs)


@dataclass
class Policy:
    """What a reward model needs of the policy: its tokenizer, data.chat_template_kwargs, whether prompts are
    conversations, and the model section (dtype, trust_remote_code) the reward model loads with."""

    tokenizer: object
    chat_template_kwargs: dict | None
    conversational: bool
    model: ModelSection


def load_rewards(g: GrpoSection, defer: bool = False, policy: Policy | None = None) -> list[Reward]:
    """The recipe's rewards, named as TRL logs them (rewards/<name>/mean; a reward model: model:<its folder's
    name>): a name used twice gets _2, ... A reward model needs `policy`."""
    out, seen = [], {}
    for i, spec in enumerate(g.rewards):
        key = f"grpo.rewards.{i}"
        if spec.model is not None:
            if policy is None:
                raise RewardError(f"{key}.model: a reward model is scored against the policy's tokenizer, not given")
            args = (spec.model, f"{key}.model", policy.tokenizer, policy.chat_template_kwargs, policy.conversational,
                    policy.model)
            fn = RewardModel(*args) if spec.aggregate is None else ProcessRewardModel(
                *args, spec.aggregate, _separator(spec, key))
            name, kind = f"model:{os.path.basename(os.path.normpath(spec.model))}", ModelReward
        else:
            fn = _builtin(spec, g.max_completion_length) or import_function(spec.function, f"{key}.function")
            builtin = spec.function in ("exact_match", "regex", "length_penalty")
            name, kind = (spec.function if builtin else fn.__name__), Reward
        seen[name] = seen.get(name, 0) + 1
        out.append(kind(fn, name if seen[name] == 1 else f"{name}_{seen[name]}", key, defer, g.reward_timeout))
    return out


def _separator(spec: RewardSpec, key: str) -> str:
    """A process reward model's step separator: the recipe's, else the one its training run wrote (recipe.yaml)."""
    folder = model_folder(spec.model)
    separator = spec.step_separator if spec.step_separator is not None else folder and trained_separator(folder)
    if not separator:  # reward_model_problems refuses this before the run; a Hub model not yet downloaded lands here
        raise RewardError(f"{key}.step_separator: {spec.model} does not say the separator it was trained at (no "
                          "recipe.yaml of a process reward run beside it): set step_separator")
    return separator


def _builtin(spec: RewardSpec, max_completion_length: int):
    if spec.function == "exact_match":
        return exact_match
    if spec.function == "regex":
        return _regex(spec.pattern)
    if spec.function == "length_penalty":
        return _length_penalty(spec.limit or 0, max_completion_length)
    return None


def dry_run(rewards: list[Reward], rows: list[dict], tokenizer, environment: type | None = None) -> None:
    """Every reward function on `rows` (prompt, reference), answered by their references and by empty completions,
    as TRL will call it (with `environment`, the guarded environment class, each completion's instance reset with its
    row, as TRL passes them): what fails here fails before the model is loaded. A reward model is not called here
    (its weights load with the policy's); its tokenizer and pad token were checked when load_rewards built it."""
    from transformers import TrainerState  # heavy import, only for the run's data phase

    conversational = isinstance(rows[0]["prompt"], list)
    answers = [r["reference"] or "" for r in rows] + [""] * len(rows)
    completions = [[{"role": "assistant", "content": a}] for a in answers] if conversational else answers
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
    kwargs = {"reference": [r["reference"] for r in rows] * 2, "trainer_state": TrainerState(),
              "log_extra": lambda *a: None, "log_metric": lambda *a: None}
    if environment is not None:
        kwargs["environments"] = [environment() for _ in answers]
        for instance, row in zip(kwargs["environments"], rows * 2):
            instance.reset(**row)
    for reward in (r for r in rewards if not isinstance(r, ModelReward)):
        reward(prompts=[r["prompt"] for r in rows] * 2, completions=completions, completion_ids=ids, **kwargs)
