"""The one guard for the user's code that GRPO runs: reward functions (rewards.py), tools (tools.py) and an
environment's constructor and methods (environments.py), each imported and called the same way, counted by one set
of counters. It isolates nothing: the code runs in the rank's own process, with its rights and its memory (copies of
the inputs, a time limit and exits caught are what it gives).

- `import_function`: `module:function` or `path/to/file.py:function`, from the working folder; an import that fails
  or exits, a name that is not there or not a plain function, is an error naming the recipe key.
- `call_user_code`: the call on deep copies of its inputs (a function that edits them changes nothing the next one
  sees; `shared` values, the trainer's own objects, are passed as they are), its prints on stderr (stdout is where
  `hftrain check` writes the resolved recipe, as YAML), within its time limit; a call that raises an Exception,
  exits (SystemExit) or runs past its limit raises `UserCodeFailure` saying how, for the caller to turn into its
  answer (a reward: an error stopping the run; a tool: "error: ..." for the model; an environment: a crash).
- `CallCounts`: what the model's calls (tools, an environment's methods) did since the last `take()`, counted here,
  once for both: calls, errors (every failure, and an answer that is not text), timeouts; crashes of environments
  and rollouts cut on an unanswered call are counted by their callers.

The time limit has two parts (`time_limit`). SIGALRM (signal.setitimer, in the main thread, where TRL calls
synchronous rewards and tools) raises in the call's own frame at the limit: Python code, `time.sleep` and `re` (sre
checks for signals) stop there, and the call counts as a time-out. Code that does not give control back to the
interpreter (a C function looping with the GIL held, which no signal handler can interrupt) is ended by the
watchdog process (watchdog.py) GRACE_S seconds later: it writes one line naming the function and the limit and
ends this process (the rank) with SIGKILL. The watchdog holds outside the main thread too, where signals are not
delivered (there, only it limits the call).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import threading
import traceback

from ...errors import RewardError
from .watchdog import hard_deadline

GRACE_S = 5.0  # after the limit, the time a call has to give control back to Python before its process is ended


@dataclasses.dataclass
class CallCounts:
    """Calls, errors and time-outs of the model's calls (tools, an environment's methods), crashes of environments
    and rollouts cut on an unanswered call (tools.unanswered_calls), since the last `take()` (logged per step)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    crashes: int = 0
    cut: int = 0

    def take(self) -> dict[str, int]:
        out = dataclasses.asdict(self)
        for name in out:
            setattr(self, name, 0)
        return out


@dataclasses.dataclass(frozen=True)
class TimeLimit:
    """The seconds a call may take and the recipe key that sets them (grpo.reward_timeout, grpo.tool_timeout)."""

    seconds: float
    key: str

    def __str__(self) -> str:
        return f"{self.key}={self.seconds:g} s"


def limit_of(seconds: float | None, key: str) -> TimeLimit | None:
    """The limit `key` sets, or None where it is 0 or unset (no limit)."""
    return TimeLimit(float(seconds), key) if seconds else None


class UserCodeFailure(Exception):
    """A call of the user's code that returned nothing: `reason` says how ("raised ...", "called sys.exit(...)", "did
    not return within ..."), `place` where in the user's code (" (at file.py:12)", or ""); `timed_out` and `exited`
    say which (after either, an object's state is unknown)."""

    def __init__(self, reason: str, place: str = "", timed_out: bool = False, exited: bool = False):
        super().__init__(reason)
        self.reason, self.place, self.timed_out, self.exited = reason, place, timed_out, exited


class CallTimeout(BaseException):
    """Raised by the SIGALRM handler inside a call that ran past its time limit. A BaseException, as KeyboardInterrupt
    is: the user's `except Exception` around a retry does not swallow it (it did, and the watchdog then ended the
    whole rank); and raised again every RETRY_S while the call goes on, for a bare `except:` that swallows it."""


class UserCodeExit(BaseException):
    """Raised in place of os._exit inside the user's code: it would end the rank at once with its status (0 too),
    saving nothing and saying nothing."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


RETRY_S = 0.05  # after the limit, the interval at which the time-out is raised again in a call that swallowed it


@contextlib.contextmanager
def time_limit(limit: TimeLimit | None, what: str):
    """CallTimeout raised in the code under it at the limit (SIGALRM, main thread only), and this process ended
    GRACE_S seconds later if that code has still not returned (the watchdog; see the module docstring). `what`
    names the call in the watchdog's line. The previous SIGALRM handler and timer are put back."""
    if limit is None:
        yield
        return
    stuck = (f"hftrain: error: {what} did not return within {limit} and did not give control back to Python "
             f"{GRACE_S:g} s later (a call stuck in C code, which no signal interrupts): this rank is ended "
             f"(SIGKILL). Make it faster, or raise {limit.key} (0: no limit)")
    with hard_deadline(limit.seconds + GRACE_S, stuck), _alarm(limit.seconds):
        yield


@contextlib.contextmanager
def _alarm(seconds: float):
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def expire(signum, frame):
        raise CallTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, RETRY_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_user_code(fn, what: str, args: tuple = (), kwargs: dict | None = None, *, limit: TimeLimit | None = None,
                   counts: CallCounts | None = None, shared: dict | None = None):
    """fn(*copies of args, **copies of kwargs, **shared), its prints on stderr, within `limit`; UserCodeFailure
    where it returns nothing (see the module docstring). `what` names it in the watchdog's line; `counts`, where
    given, counts the call, and its failure as an error (and a time-out)."""
    if counts is not None:
        counts.calls += 1
    args, kwargs = copy.deepcopy((args, kwargs or {}))
    try:
        with contextlib.redirect_stdout(sys.stderr), _no_hard_exit(), time_limit(limit, what):
            return fn(*args, **kwargs, **(shared or {}))
    except CallTimeout:
        failure = UserCodeFailure(f"did not return within {limit}", timed_out=True)
    except SystemExit as e:
        failure = UserCodeFailure(f"called sys.exit({e.code!r})", _place(e), exited=True)
    except UserCodeExit as e:
        failure = UserCodeFailure(f"called os._exit({e.code!r})", _place(e), exited=True)
    except Exception as e:  # noqa: BLE001 - the user's code, whatever it raises, is reported by its caller
        failure = UserCodeFailure(f"raised {type(e).__name__}: {e}", _place(e))
    if counts is not None:
        counts.errors += 1
        counts.timeouts += failure.timed_out
    raise failure


@contextlib.contextmanager
def _no_hard_exit():
    """os._exit raises UserCodeExit while the user's code runs, in the thread that runs it (other threads exit as
    ever; a module that bound `_exit` itself at import still ends the process: only the os module's name is
    replaced)."""
    caller = threading.get_ident()

    def refused(code):
        if threading.get_ident() != caller:
            real(code)
        raise UserCodeExit(code)

    real, os._exit = os._exit, refused
    try:
        yield
    finally:
        os._exit = real


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
