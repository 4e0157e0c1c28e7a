"""The loop over a recipe's data sources (data.sources, data.eval_sources), written once for every method's data phase
(SFT's examples aside: they are prepared once per machine into a cache, data/build.py, and split by row masks): each
source read and checked by the method (`read`: pairs, labelled examples, prompts, steps), held-out rows split off each
training source by data.eval_fraction (split.held_out_split, the one rule) or read from data.eval_sources, the
training sources mixed by weight (build.mix)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import datasets

from ..config import DataSection, DataSource
from .build import mix
from .split import held_out_split

# A row's place in its file (file:line), carried as a column through the held-out split, so that what `finish` leaves
# out (rows longer than data.max_length) is named by file and row; `finish` removes it.
PLACE = "__hftrain_place"
# read(source, key, group) -> the source's rows, checked (key: data.sources.0; group: sources or eval_sources)
ReadSource = Callable[[DataSource, str, str], datasets.Dataset]
# finish(rows, key, source) -> the rows as the method trains on them, applied after the split: rows measured against
# data.max_length are left out only then, so that which rows are held out never depends on data.max_length; KTO
# splits pairs in two only then, so that no prompt's answers are on both sides
FinishRows = Callable[[datasets.Dataset, str, DataSource], datasets.Dataset]


@dataclass
class SourceRows:
    train: datasets.Dataset  # the training sources mixed by weight
    held: list[datasets.Dataset]  # held-out parts: split off each training source, then each eval source, in order


def _as_is(rows: datasets.Dataset, key: str, src: DataSource) -> datasets.Dataset:
    return rows


def read_sources(cfg: DataSection, seed: int, read: ReadSource, finish: FinishRows = _as_is) -> SourceRows:
    """Every source of `cfg` read by `read`, held out and mixed (the module docstring)."""
    train_parts, held_parts, weights = [], [], []
    groups = [("sources", s, i) for i, s in enumerate(cfg.sources)] + [
        ("eval_sources", s, i) for i, s in enumerate(cfg.eval_sources)]
    for group, src, i in groups:
        key = f"data.{group}.{i}"
        rows = read(src, key, group)
        if group == "eval_sources":
            held_parts.append(finish(rows, key, src))
            continue
        if cfg.eval_fraction > 0:
            rows, held = held_out_split(rows, cfg.eval_fraction, seed, key, src.path)
            held_parts.append(finish(held, key, src))
        train_parts.append(finish(rows, key, src))
        weights.append(src.weight)
    return SourceRows(mix(train_parts, weights, seed), held_parts)
