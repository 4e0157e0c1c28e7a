"""What a recipe trains on, shown: rendered examples with the trained tokens marked, and per-source counts
(`hftrain data RECIPE`). It runs the training pipeline's own functions on every row; nothing here trains."""

from __future__ import annotations

import json
import statistics

from ..config import DataSection
from ..constants import IGNORE_INDEX
from .build import CANON, WHERE, canonical_source, train_on_prompt
from .render import render_examples, tokenize_examples, trainable_tokens

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


def source_report(ds, fmt: str, tokenizer, cfg: DataSection, key: str, path: str, examples: int) -> list[str]:
    """Lines about one source: its layout, how many examples its rows became and why, token statistics, what
    truncation does to it, and the examples of its first `examples` rows."""
    on_prompt = train_on_prompt(fmt, cfg, tokenizer, key)
    lengths, trained, cut, untrainable, shown, rows, split = [], [], 0, 0, [], 0, 0
    for row in ds:
        canon, source = json.loads(row[CANON]), f"{key} ({row[WHERE]})"
        outs = tokenize_examples(canon, tokenizer, on_prompt, cfg.chat_template_kwargs, source, cfg.train_turns)
        rows, split = rows + 1, split + (len(outs) > 1)
        why, turns = _why(canon, tokenizer, on_prompt, cfg, source) if len(outs) > 1 else ("", [])
        marks = []
        for k, out in enumerate(outs):
            n = len(out["input_ids"])
            kept = {name: v[: cfg.max_length] for name, v in out.items()}
            lengths.append(n)
            trained.append(trainable_tokens(kept["labels"]))
            cut += n > cfg.max_length
            untrainable += trained[-1] == 0
            what = f"example {k + 1} of {len(outs)}, trains message(s) {turns[k]}: " if turns else ""
            marks.append((f"{what}{n} tokens, {trained[-1]} trained",
                          marked(tokenizer, kept["input_ids"], kept["labels"])))
        if len(shown) < examples:
            shown.append((row[WHERE], f"{len(outs)} examples: {why}" if len(outs) > 1 else "", marks))
    over = "dropped" if cfg.truncation == "drop" else f"cut at {cfg.max_length}"
    became = (f" -> {len(lengths)} examples ({split} rows split: their template rewrites earlier turns; "
              "data.train_turns: last trains the final turn only)") if split else ""
    lines = [f"{key} ({path}): layout {fmt}, {rows} rows{became}",
             f"  tokens per example: min {min(lengths)}, median {statistics.median(lengths):g}, "
             f"mean {statistics.fmean(lengths):.1f}, max {max(lengths)}; trained tokens per example: mean "
             f"{statistics.fmean(trained):.1f}, total {sum(trained)}",
             f"  longer than data.max_length={cfg.max_length}: {cut} ({over}); left with no trained token: "
             f"{untrainable}" + (" (dropped: data.skip_untrainable)" if cfg.skip_untrainable else "")]
    for where, why, marks in shown:
        if why:
            lines.append(f"  --- {where}: {why}")
        for head, text in marks:
            lines += [f"  --- {where}: {head} ({OPEN}trained{CLOSE})", text]
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
