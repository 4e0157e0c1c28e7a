"""Every error a user can cause, and the one way they end a process: one message, exit status 2, no traceback."""

from __future__ import annotations

import contextlib
import signal
import sys

from . import distributed
from .lifetime import Terminated


class UserError(Exception):
    """Something the user can fix; the message names the key or file and the fix."""


class RecipeError(UserError, ValueError):
    """All problems of one recipe in this environment, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(f"{n} problem{'s' if n > 1 else ''} in the recipe:\n"
                         + "\n".join(f"  - {p}" for p in self.problems))


class LaunchError(UserError, RuntimeError):
    """The launched processes are not what the recipe asked for."""


class DataError(UserError, ValueError):
    """A data source that cannot be read or trained on."""


class RewardError(UserError, ValueError):
    """A GRPO reward function that cannot be loaded, raises, or returns something other than one number per
    completion."""


class ModelError(UserError, ValueError):
    """A model or tokenizer that cannot be loaded as asked."""


class MoeError(ModelError):
    """An MoE request the model cannot serve (unsupported family, bad layer list, ...)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written, or the one asked for cannot be resumed from."""


class NonFiniteError(UserError, ArithmeticError):
    """Training met a non-finite loss, gradient norm or weight: the run stops rather than train or save garbage."""


class HubError(UserError, ValueError):
    """A run that cannot (or could not) be pushed: what is wrong and how to fix it."""

    def __init__(self, problems: list[str] | str, header: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if header is None and len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            super().__init__((header or "refusing to push") + ":\n" + "\n".join(f"  - {p}" for p in self.problems))


# How a stopped run ends: 128 + the signal's number, as a shell reports a process that signal ended.
INTERRUPTED, TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM


@contextlib.contextmanager
def exit_on_user_error():
    """User errors end the process with status 2 and one message; Ctrl-C (SIGINT) with 130 and SIGTERM (for a run no
    launcher owns, lifetime.end_on_terminate) with 143, one line each: never a traceback."""
    try:
        yield
    except UserError as e:
        # Every rank hits the same error; one copy per machine (each machine's log says why it stopped).
        if distributed.is_local_main_process():
            print(f"hftrain: error: {e}", file=sys.stderr, flush=True)
        distributed.shutdown(wait=False)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, Terminated) as e:
        name, status = ("SIGINT (Ctrl-C)", INTERRUPTED) if isinstance(e, KeyboardInterrupt) else ("SIGTERM", TERMINATED)
        print(f"hftrain: stopped by {name}; checkpoints already published are complete (a save cut short stays in "
              "_incomplete/, never resumed from)", file=sys.stderr, flush=True)
        raise SystemExit(status) from None
