"""What `hftrain score` does alike for both kinds of reward model (pair_scores.py, step_scores.py): the rows' file
checked, each row's subset (a column the user names, RewardBench's `subset`), the figures per subset and over ALL
rows, the device, and the printed table and JSON made from a figures dataclass's own fields."""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from typing import Callable, TypeVar

import torch

from ...errors import DataError

KEY = "data"  # how the rows are named in messages (`data: rows.jsonl:3: chosen is empty ...`)
ALL = "all"
T = TypeVar("T")


def existing(path: str, what: str) -> str:
    """`path`, or a DataError saying what the file should hold."""
    if not os.path.exists(path):
        raise DataError(f"{KEY}: {path} does not exist; give a local file of {what} or a saved dataset folder")
    return path


def subset_of(row: dict, column: str | None, where: str) -> str:
    """A row's subset: the value of `column`, or ALL when no column is given."""
    if column is None:
        return ALL
    if column not in row:
        raise DataError(f"{KEY}: {where}: no {column!r} column (the row has {list(row)}); name the rows' subset "
                        "column with --subset, or leave it out to score every row as one set")
    return str(row[column])


def per_subset(values: list, subsets: list[str], figures: Callable[[list], T]) -> dict[str, T]:
    """`figures` of each subset's values (in first-seen order) and of ALL of them."""
    groups: dict[str, list] = {}
    for value, subset in zip(values, subsets):
        groups.setdefault(subset, []).append(value)
    groups[ALL] = list(values)
    return {name: figures(group) for name, group in groups.items()}


def device_of(device: str | None) -> torch.device:
    """The device asked for, else cuda where there is one, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def table(scores: dict) -> str:
    """The scores as the command prints them: a column per field of their dataclass, a line per subset, ALL last."""
    names = [f.name for f in fields(next(iter(scores.values())))]
    heads = [name.replace("_", " ").replace(" f1", " F1") for name in names]
    width = max(len("subset"), *(len(name) for name in scores))
    lines = ["  ".join([f"{'subset':<{width}}"] + [f"{h:>6}" for h in heads])]
    for name in [n for n in scores if n != ALL] + [ALL]:
        values = [getattr(scores[name], n) for n in names]
        cells = [f"{v:>{max(6, len(h))}}" if isinstance(v, int) else f"{v:>{max(6, len(h))}.4f}"
                 for v, h in zip(values, heads)]
        lines.append("  ".join([f"{name:<{width}}"] + cells))
    return "\n".join(lines)


def as_json(model_name: str, path: str, kind: str, scores: dict) -> dict:
    return {"model": model_name, "data": path, "kind": kind, "subsets": {n: asdict(s) for n, s in scores.items()}}
