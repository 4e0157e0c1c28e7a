"""GRPO's reward functions: the built-ins a recipe names, the user's own, and the checks that turn a bad one into one
clear error naming it (errors.RewardError, exit 2) rather than a traceback or a NaN advantage.

    exact_match     1 when the completion equals the row's reference answer (both whitespace-stripped), else 0
    regex           1 when the whole completion matches `pattern` (re.fullmatch, DOTALL), else 0
    length_penalty  -(completion tokens beyond `limit`) / grpo.max_completion_length
    module:function or path/to/file.py:function: your own

Each is called as TRL's GRPOTrainer 1.16 calls reward functions: fn(prompts, completions, completion_ids, reference,
trainer_state, log_extra, log_metric), with completions as text, or as [{"role": "assistant", "content": ...}] for
conversation prompts; it returns one number per completion (None: does not apply). Why hftrain checks: TRL checks
only the length (a bare ValueError), turns None into NaN and hands anything else to torch.tensor, and a function that
raises on one rank leaves the others waiting in the rewards' all-gather. Here a function that raises, exits, returns
the wrong number of values or a non-number, or runs past grpo.reward_timeout is reported with its name, and (`defer`)
the error is held until after the all-gather, where every rank raises it (GroupTrainer). Each call gets its own
copies of the data (a function that edits its inputs changes nothing the next one sees), and what it prints goes to
stderr (stdout is where `hftrain check` writes the resolved recipe, as YAML). `dry_run` calls every function on the
data before the model loads, so what can be caught before any weight moves is.

The time limit is SIGALRM's (signal.setitimer) in the main thread, where TRL calls synchronous reward functions: the
handler raises in the function's own frame, which also interrupts a regular expression stuck backtracking (sre checks
for signals) and a sleep; nothing kills a thread, so a thread would leave the hung call running beside training.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import math
import os
import re
import signal
import sys
import threading
import traceback

from .grpo_section import GrpoSection, RewardSpec
from ..errors import RewardError


def text_of(completion) -> str:
    """The text of a completion: itself, or the content of its last assistant message (a tool-using rollout is the
    assistant's turns with the tools' answers between them: the answer is the final turn, never a tool's output)."""
    if isinstance(completion, str):
        return completion
    said = [m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant"]
    return said[-1] if said else ""


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


def import_function(spec: str, where: str):
    """The function `module:function` or `path/to/file.py:function` names, imported from the working folder; `where`
    is the recipe key messages name (grpo.rewards.0.function, grpo.tools.0)."""
    module, _, name = spec.rpartition(":")
    with contextlib.redirect_stdout(sys.stderr):  # its top level's prints: off `hftrain check`'s YAML
        return _function_of(_module(module, where), module, name, spec, where)


def _module(module: str, where: str):
    try:
        if module.endswith(".py"):
            path = os.path.abspath(module)
            if not os.path.isfile(path):
                raise RewardError(f"{where}: {module} does not exist (relative to {os.getcwd()})")
            loader = importlib.util.spec_from_file_location(f"hftrain_reward_{abs(hash(path))}", path)
            mod = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(mod)
        else:
            if os.getcwd() not in sys.path:  # a module beside the recipe, as `python -m` would find it
                sys.path.insert(0, os.getcwd())
            mod = importlib.import_module(module)
    except RewardError:
        raise
    except SystemExit as e:  # sys.exit() at import would end `check` and the run with its status and no word
        raise RewardError(f"{where}: importing {module} called sys.exit({e.code!r}){_place(e)}: a "
                          "module must not exit; move that code under `if __name__ == \"__main__\":`") from None
    except Exception as e:  # ImportError, SyntaxError, or whatever its top level raises
        raise RewardError(f"{where}: cannot import {module}: {type(e).__name__}: {e}{_place(e)}") from None
    return mod


def _function_of(mod, module: str, name: str, spec: str, where: str):
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise RewardError(f"{where}: {module} has no function {name!r}"
                          + (f" ({name} is {type(fn).__name__})" if fn is not None else ""))
    if inspect.iscoroutinefunction(fn):
        raise RewardError(f"{where}: {spec} is async; give a plain function")
    return fn


def _place(e: BaseException) -> str:
    """' (at file.py:12)': where in the user's code an exception was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


# What TRL hands a reward function that is not data: the trainer's state, its loggers, the environments. Everything
# else (prompts, completions, completion_ids, the rows' columns) is copied for each function.
NOT_COPIED = ("trainer_state", "log_extra", "log_metric", "environments")


class CallTimeout(Exception):
    """Raised by the SIGALRM handler inside a reward function that ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """CallTimeout raised in the code under it after `seconds` (None or 0, or outside the main thread, where
    signals cannot be handled: no limit). The previous SIGALRM handler and timer are put back."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise CallTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Reward:
    """One reward function as TRL calls it, on copies of its inputs, within `timeout` seconds, its prints on stderr,
    its result checked. `defer`: an error is kept in `error` (and None returned for every completion) instead of
    raised, for the caller to raise on every rank at once."""

    def __init__(self, fn, name: str, key: str, defer: bool = False, timeout: float | None = None):
        self.fn, self.__name__, self.key, self.defer, self.error = fn, name, key, defer, None
        self.timeout = timeout

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
        data = copy.deepcopy({"prompts": prompts, "completions": completions,
                              **{k: v for k, v in kwargs.items() if k not in NOT_COPIED}})
        try:
            with contextlib.redirect_stdout(sys.stderr), time_limit(self.timeout):
                return self.fn(**data, **{k: v for k, v in kwargs.items() if k in NOT_COPIED})
        except CallTimeout:
            raise RewardError(f"{what} did not return within grpo.reward_timeout={self.timeout:g} s (for "
                              f"{len(completions)} completions); make it faster, or raise grpo.reward_timeout "
                              "(0: no limit)") from None
        except SystemExit as e:
            raise RewardError(f"{what} called sys.exit({e.code!r}){_place(e)}; return a list of numbers "
                              "instead") from None
        except Exception as e:
            raise RewardError(f"{what} raised {type(e).__name__}: {e}{_place(e)}") from None

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


def load_rewards(g: GrpoSection, defer: bool = False) -> list[Reward]:
    """The recipe's reward functions, named as TRL logs them (rewards/<name>/mean): a name used twice gets _2, ..."""
    out, seen = [], {}
    for i, spec in enumerate(g.rewards):
        key = f"grpo.rewards.{i}"
        fn = _builtin(spec, g.max_completion_length) or import_function(spec.function, f"{key}.function")
        name = spec.function if spec.function in ("exact_match", "regex", "length_penalty") else fn.__name__
        seen[name] = seen.get(name, 0) + 1
        out.append(Reward(fn, name if seen[name] == 1 else f"{name}_{seen[name]}", key, defer, g.reward_timeout))
    return out


def _builtin(spec: RewardSpec, max_completion_length: int):
    if spec.function == "exact_match":
        return exact_match
    if spec.function == "regex":
        return _regex(spec.pattern)
    if spec.function == "length_penalty":
        return _length_penalty(spec.limit or 0, max_completion_length)
    return None


def dry_run(rewards: list[Reward], rows: list[dict], tokenizer) -> None:
    """Every reward function on `rows` (prompt, reference), answered by their references and by empty completions,
    as TRL will call it: what fails here fails before the model is loaded."""
    from transformers import TrainerState  # heavy import, only for the run's data phase

    conversational = isinstance(rows[0]["prompt"], list)
    answers = [r["reference"] or "" for r in rows] + [""] * len(rows)
    completions = [[{"role": "assistant", "content": a}] for a in answers] if conversational else answers
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
    kwargs = {"reference": [r["reference"] for r in rows] * 2, "trainer_state": TrainerState(),
              "log_extra": lambda *a: None, "log_metric": lambda *a: None}
    for reward in rewards:
        reward(prompts=[r["prompt"] for r in rows] * 2, completions=completions, completion_ids=ids, **kwargs)
