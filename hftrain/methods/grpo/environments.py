"""GRPO's environment (`grpo.environment: module:Class`), run by TRL 1.16's `environment_factory` (experimental in
TRL): one instance per rollout, pooled and reset between batches; `reset(**row)` starts a rollout from the data row
(a text it returns is appended to the prompt); its public methods are the model's tools (their JSON schemas from type
hints and docstrings, as for grpo.tools); `get_reward()`, when defined, scores the finished rollout (logged under the
class's name, weight 1, beside grpo.rewards).

TRL calls all of these directly: an environment that raises in `reset` or `get_reward` stops the run, and one that
hangs hangs the rank. Here TRL is handed a stand-in class (`guarded_environment`) with the same public methods, names,
signatures and docstrings, holding the user's instance:

- every call (constructor, `reset`, methods, `get_reward`) runs in the user-code guard (user_code.call_user_code:
  copies of its arguments, its prints on stderr, grpo.tool_timeout); a method call is counted as a tool's is, by the
  guard's one set of counters (tools/errors, tools/timeouts); one that raises an Exception answers the model
  "error: ..." (the environment refused the action, e.g. an illegal move);
- the environment **crashes** when its constructor, `reset` or `get_reward` raises, `get_reward` returns what is not
  a finite number, or a method runs past the time limit or exits (its state is then unknown): the rollout's later
  calls answer "error: the environment crashed ...", its `get_reward` is 0.0, the crash is printed on stderr once and
  counted (tools/env_crashes); the next `reset` builds a fresh instance. Reward functions see it as
  `environments[i].crashed` (TRL passes `environments`, the stand-ins), and the instance's own attributes through
  the stand-in. A call stuck in C code past the limit ends the rank, named,
  by the guard's watchdog (a new process per call could not hold the instance's state).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

from .grpo_section import GrpoSection
from ...errors import RewardError
from .user_code import CallCounts, TimeLimit, UserCodeFailure, call_user_code, import_function, limit_of
from .tools import load_tools, schema_problem, text_answer

RESERVED = ("reset", "get_reward")


def public_methods(cls) -> dict:
    """The methods TRL makes tools of: the class's public functions, reset and get_reward excepted."""
    return {name: fn for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in RESERVED}


class _Guarded:
    """The stand-in's machinery (guarded_environment makes a subclass per environment class)."""

    _cls: type
    _limit: TimeLimit | None
    _counts: CallCounts

    def __init__(self):
        self._inner, self.crashed = None, None
        self._fresh()

    def _fresh(self) -> None:
        self.crashed = None
        try:
            self._inner = self._run(self._cls, f"{self._cls.__name__}()")
        except UserCodeFailure as e:  # a crash, reported; the next reset tries again
            self._crash(f"{self._cls.__name__}() {e.reason}")

    def _run(self, fn, what: str, args: tuple = (), kwargs: dict | None = None, counts: CallCounts | None = None):
        """fn(*args, **kwargs) in the user-code guard (user_code.call_user_code), counted in `counts` where given."""
        return call_user_code(fn, f"the environment's {what}", args, kwargs, limit=self._limit, counts=counts)

    def __getattr__(self, name: str):
        """The user's instance's attributes, as reward functions read them (TRL passes them this stand-in)."""
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            crashed = self.__dict__.get("crashed")
            raise AttributeError(f"{self._cls.__name__} has no attribute {name!r}"
                                 + (f" (the environment crashed: {crashed})" if crashed else ""))
        return getattr(inner, name)

    def _crash(self, what: str) -> None:
        self.crashed, self._inner = what, None
        self._counts.crashes += 1
        print(f"hftrain: warning: the GRPO environment crashed: {what}; this rollout gets reward 0", file=sys.stderr,
              flush=True)

    def reset(self, **row):
        if self._inner is None:
            self._fresh()
        if self.crashed:
            return None
        try:
            return self._run(self._inner.reset, f"{self._cls.__name__}.reset", kwargs=row)
        except UserCodeFailure as e:  # a crash, reported; the run goes on
            self._crash(f"reset {e.reason}")
        return None


def _guarded_method(name: str, fn):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        if self.crashed:
            self._counts.calls += 1
            self._counts.errors += 1
            return f"error: the environment crashed ({self.crashed}); nothing more can be done in this rollout"
        try:
            result = self._run(getattr(self._inner, name), f"{self._cls.__name__}.{name}", args, kwargs,
                               counts=self._counts)
        except UserCodeFailure as e:
            if e.timed_out or e.exited:  # its state is unknown: the rollout ends
                self._crash(f"{name} {e.reason}")
                return f"error: {name} {e.reason}: the environment crashed"
            return f"error: {name} {e.reason}"  # the environment refused the call: the model is told
        return text_answer(name, result, self._counts)

    return method


def _get_reward(self) -> float:
    if self.crashed or self._inner is None:
        return 0.0
    try:
        value = self._run(self._inner.get_reward, f"{self._cls.__name__}.get_reward")
    except UserCodeFailure as e:  # a crash, reported: reward 0 for this rollout
        self._crash(f"get_reward {e.reason}")
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        self._crash(f"get_reward returned {value!r} ({type(value).__name__}), not a finite number")
        return 0.0
    return float(value)


def guarded_environment(cls: type, limit: TimeLimit | None, counts: CallCounts) -> type:
    """The class TRL's environment_factory builds instead of `cls` (see the module docstring)."""
    namespace = {"_cls": cls, "_limit": limit, "_counts": counts, "__doc__": cls.__doc__,
                 **{name: _guarded_method(name, fn) for name, fn in public_methods(cls).items()}}
    if callable(getattr(cls, "get_reward", None)):
        namespace["get_reward"] = _get_reward
    return type(cls.__name__, (_Guarded,), namespace)


def load_environment(g: GrpoSection, counts: CallCounts | None = None) -> type | None:
    """The recipe's environment class, guarded; refused naming the key when TRL could not use it."""
    if not g.environment:
        return None
    cls = import_function(g.environment, "grpo.environment")
    problem = environment_problem(cls)
    if problem:
        raise RewardError(f"grpo.environment: {g.environment}: {problem}")
    if not g.rewards and not callable(getattr(cls, "get_reward", None)):
        raise RewardError(f"grpo.rewards is empty and grpo.environment {g.environment} defines no get_reward(): "
                          "add a reward function, or a get_reward method returning the rollout's reward")
    return guarded_environment(cls, limit_of(g.tool_timeout, "grpo.tool_timeout"),
                               counts if counts is not None else CallCounts())


def shown_tools(g: GrpoSection) -> list:
    """The functions whose schemas the chat template shows the model in every prompt: grpo.tools, then the
    environment's methods (TRL renders each prompt with both)."""
    env = load_environment(g)
    methods = [_unbound_schema_target(fn) for fn in public_methods(env).values()] if env else []
    tools = load_tools(g)
    taken = {fn.__name__ for fn in methods}
    for i, tool in enumerate(tools):
        if tool.__name__ in taken:
            raise RewardError(f"grpo.tools.{i}: {g.tools[i]} is named {tool.__name__!r}, as a method of "
                              f"grpo.environment {g.environment} is: the model would see two tools of one name and "
                              "could call only one; rename one of them")
    return tools + methods


def environment_problem(cls) -> str | None:
    """Why TRL cannot use `cls` as an environment, or None."""
    if not inspect.isclass(cls):
        return f"is a {type(cls).__name__}, not a class"
    if not callable(getattr(cls, "reset", None)):
        return "defines no reset() (TRL starts each rollout with it)"
    if not public_methods(cls):
        return "has no public method for the model to call (each becomes a tool)"
    for name, fn in public_methods(cls).items():
        problem = schema_problem(_unbound_schema_target(fn))
        if problem:
            return (f"its method {name}: transformers cannot build its JSON schema ({problem}); give every argument "
                    "a type hint and the method a Google-style docstring with an Args: section")
    return None


def _unbound_schema_target(fn):
    """A function with `fn`'s signature less `self` and its docstring: what the model is shown of the method."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1:]

    def target(*args, **kwargs):
        return None

    functools.update_wrapper(target, fn)
    del target.__wrapped__
    target.__signature__ = signature.replace(parameters=params)
    return target
