"""What a recipe trains on, shown: rendered examples with the trained tokens marked, and per-source counts
(`hftrain data RECIPE`). It runs the training pipeline's own functions on every row; nothing here trains."""

from __future__ import annotations

import json
import statistics

from ..config import DataSection
from ..constants import IGNORE_INDEX
from .build import CANON, WHERE, canonical_source, train_on_prompt
from .render import tokenize_example, trainable_tokens

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


def source_report(ds, fmt: str, tokenizer, cfg: DataSection, key: str, path: str, examples: int) -> list[str]:
    """Lines about one source: its layout, token statistics, what truncation does to it, and `examples` rows."""
    on_prompt = train_on_prompt(fmt, cfg, tokenizer, key)
    lengths, trained, cut, untrainable, shown = [], [], 0, 0, []
    for row in ds:
        out = tokenize_example(json.loads(row[CANON]), tokenizer, on_prompt, cfg.chat_template_kwargs,
                               f"{key} ({row[WHERE]})")
        n = len(out["input_ids"])
        kept = {k: v[: cfg.max_length] for k, v in out.items()}
        lengths.append(n)
        trained.append(trainable_tokens(kept["labels"]))
        cut += n > cfg.max_length
        untrainable += trained[-1] == 0
        if len(shown) < examples:
            shown.append((row[WHERE], n, trained[-1], marked(tokenizer, kept["input_ids"], kept["labels"])))
    over = "dropped" if cfg.truncation == "drop" else f"cut at {cfg.max_length}"
    lines = [f"{key} ({path}): layout {fmt}, {len(lengths)} rows",
             f"  tokens per row: min {min(lengths)}, median {statistics.median(lengths):g}, "
             f"mean {statistics.fmean(lengths):.1f}, max {max(lengths)}; trained tokens per row: mean "
             f"{statistics.fmean(trained):.1f}, total {sum(trained)}",
             f"  longer than data.max_length={cfg.max_length}: {cut} ({over}); left with no trained token: "
             f"{untrainable}" + (" (dropped: data.skip_untrainable)" if cfg.skip_untrainable else "")]
    for where, n, t, text in shown:
        lines += [f"  --- {where}: {n} tokens, {t} trained ({OPEN}trained{CLOSE})", text]
    return lines


def preview(cfg: DataSection, tokenizer, examples: int = 2) -> str:
    """The report of every training and eval source of a data section."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    lines = []
    for prefix, sources in (("data.sources", cfg.sources), ("data.eval_sources", cfg.eval_sources)):
        for i, src in enumerate(sources):
            key = f"{prefix}.{i}"
            ds, fmt = canonical_source(src, key, has_template)
            lines += source_report(ds, fmt, tokenizer, cfg, key, src.path, examples)
    return "\n".join(lines)
