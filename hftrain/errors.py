"""User errors end the process with one clear message and exit status 2, not a traceback."""

from __future__ import annotations

import contextlib
import sys

from . import distributed


def user_error_types() -> tuple[type, ...]:
    from .checkpoints import CheckpointError
    from .data import DataError
    from .modeling import ModelError
    from .recipe import RecipeError
    from .engine import LaunchError
    from .hub import HubError

    return (RecipeError, DataError, ModelError, LaunchError, HubError, CheckpointError)


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except user_error_types() as e:
        # Every rank hits the same error; one copy of the message is enough.
        if distributed.is_main_process():
            print(f"hftrain: error: {e}", file=sys.stderr, flush=True)
        distributed.shutdown(wait=False)
        raise SystemExit(2) from None
