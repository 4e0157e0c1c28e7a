"""Every error a user can cause, and the one way they end a process: one message, exit status 2, no traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time

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


class GateError(UserError, RuntimeError):
    """A benchmark gate the recipe set (eval.harness.min_delta) was missed: what regressed."""


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


# How long a rank other than its machine's first waits, after a user error, for that first rank to say it.
SILENT_RANK_GRACE_S = 30
# A marker older than this process's start (its import of this module) is another job's.
_IMPORTED_AT = time.time()


def _said_marker() -> str:
    """A file the machine's first rank writes once it has said the error: its siblings share the launcher's process
    (their parent) and its restart count."""
    name = f"hftrain-error-said-{os.getppid()}-{distributed.elastic_restart_count()}"
    return os.path.join(tempfile.gettempdir(), name)


def say_once_per_machine(message: str) -> None:
    """Every rank usually hits the same error: the machine's first rank says it, once per machine. A sibling that
    exited at once could beat it, and the launcher would then end the first rank (SIGTERM) before it printed: the
    job failed with no message (seen in CI). So a sibling exits only once the first rank has said it (its marker,
    newer than this process), or, after the grace (the error was its own alone), says it itself. Every rank still
    ends by itself, within moments of the others. The process group is shut down after the message."""
    marker = _said_marker()
    if distributed.is_local_main_process():
        print(message, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            open(marker, "w").close()
    else:
        deadline = time.monotonic() + SILENT_RANK_GRACE_S
        while not _newer_than(marker, _IMPORTED_AT):
            if time.monotonic() > deadline:
                print(f"[rank {distributed.rank()}] {message}", file=sys.stderr, flush=True)
                break
            time.sleep(0.02)
    distributed.shutdown(wait=False)


def _newer_than(path: str, when: float) -> bool:
    try:
        return os.path.getmtime(path) >= when
    except OSError:
        return False


@contextlib.contextmanager
def exit_on_user_error():
    """User errors end the process with status 2 and one message; Ctrl-C (SIGINT) with 130 and SIGTERM (for a run no
    launcher owns, lifetime.end_on_terminate) with 143, one line each: never a traceback."""
    try:
        yield
    except UserError as e:
        say_once_per_machine(f"hftrain: error: {e}")  # and shuts the process group down
        raise SystemExit(2) from None
    except (KeyboardInterrupt, Terminated) as e:
        name, status = ("SIGINT (Ctrl-C)", INTERRUPTED) if isinstance(e, KeyboardInterrupt) else ("SIGTERM", TERMINATED)
        print(f"hftrain: stopped by {name}; checkpoints already published are complete (a save cut short stays in "
              "_incomplete/, never resumed from)", file=sys.stderr, flush=True)
        raise SystemExit(status) from None
