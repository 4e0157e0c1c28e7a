"""What a recipe trains on, shown: per-source statistics from the prepared data (every example, read from the
cache's columns, so a million rows answer in seconds once prepared) and the first examples rendered with the trained
tokens marked (`hftrain data RECIPE`); a row that became several examples (its template rewrites earlier turns) is
shown as each of them, with why. A streaming recipe is never prepared whole: its statistics are those of the
first rows of each source, and the report says so. Nothing here trains."""

from __future__ import annotations

import numpy as np

from ..config import DataSection
from ..constants import IGNORE_INDEX
from .build import Prepared, prepare_all, prepare_sample
from .render import render_examples
from .rows import train_on_prompt
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


def _why(canon: dict, tokenizer, on_prompt: bool, cfg: DataSection, source: str) -> tuple[str, list[list[int]]]:
    """Why a row became several examples, and the assistant messages each one trains."""
    exs = render_examples(canon, tokenizer, on_prompt, cfg.chat_template_kwargs, source, cfg.train_turns)
    split = [ex.turns[-1] for ex in exs if ex.split]
    why = (f"the chat template writes assistant message(s) {', '.join(map(str, split))} differently once later "
           "messages follow (it rewrites earlier turns, e.g. drops their reasoning), so each is trained in an "
           "example that ends with it")
    return why, [ex.turns for ex in exs]


def _shown(p: Prepared, tokenizer, cfg: DataSection, rows: int) -> list[str]:
    """The examples of the first `rows` rows as they train; a row that became several says why."""
    lines, on_prompt = [], None
    row_of = p.column("row")  # ascending: the map keeps the rows' order, and every row gives an example
    for row in range(min(rows, p.rows.count)):
        first, last = np.searchsorted(row_of, row), np.searchsorted(row_of, row, side="right")
        where = p.rows.where(row)
        turns = []
        if last - first > 1:
            on_prompt = train_on_prompt(p.layout.fmt, cfg, tokenizer, p.key) if on_prompt is None else on_prompt
            why, turns = _why(p.canonical(row), tokenizer, on_prompt, cfg, f"{p.key} ({where})")
            lines.append(f"  --- {where}: {last - first} examples: {why}")
        for k in range(first, last):
            ex = p.tokenised[int(k)]
            ids, labels = ex["input_ids"][:cfg.max_length], ex["labels"][:cfg.max_length]
            what = f"example {k - first + 1} of {last - first}, trains message(s) {turns[k - first]}: " if turns else ""
            lines += [f"  --- {where}: {what}{ex['n_tokens']} tokens, {ex['n_trainable']} trained "
                      f"({OPEN}trained{CLOSE})", marked(tokenizer, ids, labels)]
    return lines


def source_report(p: Prepared, tokenizer, cfg: DataSection, examples: int) -> list[str]:
    """Lines about one prepared source: its layout, how many examples its rows became and why, token statistics,
    what truncation does to it, and the examples of its first `examples` rows as they train."""
    lengths, trained = p.column("n_tokens"), p.column("n_trainable")
    too_long = lengths > cfg.max_length
    untrainable = (trained == 0) & ~too_long if cfg.truncation == "drop" else trained == 0
    over = "dropped" if cfg.truncation == "drop" else f"cut at {cfg.max_length}"
    split = int((np.bincount(p.column("row")) > 1).sum())
    counted = (f"all {len(lengths)} examples (prepared: {p.cache_file})" if p.cache_file
               else f"the {len(lengths)} examples of the first {p.rows.count} rows (streaming: never prepared whole)")
    became = (f" -> {len(lengths)} examples ({split} rows split: their template rewrites earlier turns; "
              "data.train_turns: last trains the final turn only)") if split else ""
    lines = [f"{p.key} ({p.src.path}): layout {p.layout.fmt}, {p.rows.count} rows{became}",
             f"  statistics of {counted}",
             f"  tokens per example: min {lengths.min()}, median {np.median(lengths):g}, mean {lengths.mean():.1f}, "
             f"max {lengths.max()}; trained tokens per example: mean {trained.mean():.1f}, total {int(trained.sum())}",
             f"  longer than data.max_length={cfg.max_length}: {int(too_long.sum())} ({over}); left with no trained "
             f"token: {int(untrainable.sum())}" + (" (dropped: data.skip_untrainable)" if cfg.skip_untrainable else "")]
    return lines + _shown(p, tokenizer, cfg, examples)


def preview(cfg: DataSection, tokenizer, examples: int = 2) -> str:
    """The report of every training and eval source of a data section."""
    if cfg.streaming:
        train = [prepare_sample(s, f"data.sources.{i}", tokenizer, cfg, CHECK_ROWS) for i, s in enumerate(cfg.sources)]
        held = prepare_all(cfg, tokenizer)[1]
    else:
        train, held = prepare_all(cfg, tokenizer)
    return "\n".join(line for p in train + held for line in source_report(p, tokenizer, cfg, examples))
