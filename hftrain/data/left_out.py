"""Rows a method's data phase leaves out, said one way for pairs (DPO's and the reward models'), KTO's examples, step
rows and image rows: how many of the source's rows, the first of them by file and row, and the fix; a source none of
whose rows fit is a DataError naming data.max_length. Each method says why its rows do not fit (a prompt that fills
max_length, a side longer than it, a row whose cut would lose labels, an image row with nothing to train)."""

from __future__ import annotations

import sys

from ..distributed import print0
from ..errors import DataError

SHOWN = 5  # rows named by place in a message; the rest are counted


def first_places(places: list[str]) -> str:
    """The first SHOWN places (file:line), then how many more."""
    more = f" and {len(places) - SHOWN} more" if len(places) > SHOWN else ""
    return ", ".join(places[:SHOWN]) + more


def say_left_out(key: str, path: str, left_out: list[str], total: int, what: str, why: str,
                 fix: str = "raise data.max_length to keep them") -> None:
    """Print (rank 0, stderr) that `left_out` (their places) of the source's `total` `what` are left out, why, and
    the fix."""
    if left_out:
        print0(f"hftrain: {key}: {len(left_out)} of {total} {what} of {path} are left out: {why} "
               f"({first_places(left_out)}); {fix}", file=sys.stderr)


def none_left(key: str, path: str, total: int, what: str, why_every: str, fix: str) -> DataError:
    """The error of a source none of whose `total` `what` fit: `why_every` says why (the shortest's length in it)."""
    return DataError(f"{key}: every one of the {total} {what} of {path} {why_every}; {fix}")
