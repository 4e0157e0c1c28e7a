"""What a recipe trains on, shown: per-source statistics from the prepared data (every example, read from the
cache's columns, so a million rows answer in seconds once prepared) and the first examples rendered with the trained
tokens marked (`hftrain data RECIPE`). A streaming recipe is never prepared whole: its statistics are those of the
first rows of each source, and the report says so. Nothing here trains."""

from __future__ import annotations

import numpy as np

from ..config import DataSection
from ..constants import IGNORE_INDEX
from .build import Prepared, prepare_all, prepare_sample
from .stream import CHECK_ROWS

OPEN, CLOSE = "[[", "]]"  # around each run of trained tokens


def marked(tokenizer, input_ids: list[int], labels: list[int]) -> str:
    """The example's text with every run of trained tokens between [[ and ]] (decoded run by run, so a character
    split over tokens stays whole)."""
    parts, run, trained = [], [], False
    for tok, lab in zip(input_ids, labels):
        if (lab != IGNORE_INDEX) != trained and run:
            text = tokenizer.decode(run)
            parts.append(f"{OPEN}{text}{CLOSE}" if trained else text)
            run = []
        trained = lab != IGNORE_INDEX
        run.append(tok)
    if run:
        text = tokenizer.decode(run)
        parts.append(f"{OPEN}{text}{CLOSE}" if trained else text)
    return "".join(parts)


def source_report(p: Prepared, tokenizer, cfg: DataSection, examples: int) -> list[str]:
    """Lines about one prepared source: its layout, token statistics, what truncation does to it, and the first
    `examples` examples as they train."""
    lengths, trained = p.column("n_tokens"), p.column("n_trainable")
    too_long = lengths > cfg.max_length
    untrainable = (trained == 0) & ~too_long if cfg.truncation == "drop" else trained == 0
    over = "dropped" if cfg.truncation == "drop" else f"cut at {cfg.max_length}"
    counted = (f"all {len(lengths)} examples (prepared: {p.cache_file})" if p.cache_file
               else f"the {len(lengths)} examples of the first {p.rows.count} rows (streaming: never prepared whole)")
    lines = [f"{p.key} ({p.src.path}): layout {p.layout.fmt}, {p.rows.count} rows",
             f"  statistics of {counted}",
             f"  tokens per row: min {lengths.min()}, median {np.median(lengths):g}, mean {lengths.mean():.1f}, max "
             f"{lengths.max()}; trained tokens per row: mean {trained.mean():.1f}, total {int(trained.sum())}",
             f"  longer than data.max_length={cfg.max_length}: {int(too_long.sum())} ({over}); left with no trained "
             f"token: {int(untrainable.sum())}" + (" (dropped: data.skip_untrainable)" if cfg.skip_untrainable else "")]
    for i in range(min(examples, len(p.tokenised))):
        ex = p.tokenised[i]
        ids, labels = ex["input_ids"][:cfg.max_length], ex["labels"][:cfg.max_length]
        lines += [f"  --- {p.rows.where(ex['row'])}: {ex['n_tokens']} tokens, {ex['n_trainable']} trained "
                  f"({OPEN}trained{CLOSE})", marked(tokenizer, ids, labels)]
    return lines


def preview(cfg: DataSection, tokenizer, examples: int = 2) -> str:
    """The report of every training and eval source of a data section."""
    if cfg.streaming:
        train = [prepare_sample(s, f"data.sources.{i}", tokenizer, cfg, CHECK_ROWS) for i, s in enumerate(cfg.sources)]
        held = prepare_all(cfg, tokenizer)[1]
    else:
        train, held = prepare_all(cfg, tokenizer)
    return "\n".join(line for p in train + held for line in source_report(p, tokenizer, cfg, examples))
