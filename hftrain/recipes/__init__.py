"""The recipe scripts, one per command: each runs the shared run (hftrain/lifecycle.py) with the recipe's method
(hftrain/methods/), refusing a recipe whose method another script runs.

    hftrain sft RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.sft RECIPE ...)
    hftrain dpo RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.dpo RECIPE ...)
    hftrain grpo RECIPE [key=value ...]       (or: accelerate launch ... -m hftrain.recipes.grpo RECIPE ...)

`recipes/sft.py`, `recipes/dpo.py` and `recipes/grpo.py` in the repository run these same modules. They live in the
package so that `hftrain sft RECIPE` works after a plain `pip install`, and are named after the commands.
"""

from __future__ import annotations

import functools
import gc
import sys
from typing import Callable

from ..errors import exit_on_user_error
from ..lifecycle import run


@functools.cache  # once per process: what a later run in the same process makes (a test, a notebook) stays collectable
def freeze_imports() -> None:
    """The imports' ~700,000 objects out of the collector's view: each full collection of a run (the process group's
    shutdown, accelerate's free_memory, the collector's own passes) walked them, 0.37 s each on 2 cores."""
    gc.freeze()


def entry(script: str) -> Callable[[list[str] | None], None]:
    """The `main(argv)` of recipe script `script`: argv defaults to the command line's."""

    def main(argv: list[str] | None = None) -> None:
        freeze_imports()
        with exit_on_user_error():
            run(script, sys.argv[1:] if argv is None else argv)

    return main
