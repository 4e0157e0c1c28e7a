"""The recipe scripts, one per command: each runs the shared run (hftrain/lifecycle.py) with the recipe's method
(hftrain/methods/), refusing a recipe whose method another script runs.

    hftrain sft RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.sft RECIPE ...)
    hftrain dpo RECIPE [key=value ...]        (or: accelerate launch ... -m hftrain.recipes.dpo RECIPE ...)
    hftrain grpo RECIPE [key=value ...]       (or: accelerate launch ... -m hftrain.recipes.grpo RECIPE ...)

`recipes/sft.py`, `recipes/dpo.py` and `recipes/grpo.py` in the repository run these same modules. They live in the
package so that `hftrain sft RECIPE` works after a plain `pip install`, and are named after the commands.
"""

from __future__ import annotations

import sys
from typing import Callable

from ..errors import exit_on_user_error
from ..lifecycle import run


def entry(script: str) -> Callable[[list[str] | None], None]:
    """The `main(argv)` of recipe script `script`: argv defaults to the command line's."""

    def main(argv: list[str] | None = None) -> None:
        with exit_on_user_error():
            run(script, sys.argv[1:] if argv is None else argv)

    return main
