"""One row as read -> the examples it trains on: its canonical form (layouts.py), its text cut to a bound derived
from data.max_length, token ids and labels (render.py's tokenize_examples: one example, or one per assistant turn
its template writes differently once later messages follow, per data.train_turns), the length before truncation and
the trainable tokens after it, and the row's index (its name in the user's numbering is made only for a message).
`RowExamples` is a batched datasets map function (num_proc workers pickle it) and the streaming pipeline's per-row
step alike; its output has a row per example, so more rows than its input where a row becomes several.

The text is cut before tokenisation to a bound derived from data.max_length, and tokenised uncut where the
cut would change what trains (cut.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import datasets

from ..config import DataSection, DataSource
from ..errors import DataError
from .cut import bounded, char_bound, cut_changes
from .layouts import canonical_row, source_layout
from .render import tokenize_examples, trainable_tokens
from .sources import FILE, JSON, LINE, RowNames, Rows, row_size_problem

TOKENISED = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "labels": datasets.List(datasets.Value("int32")),
    "n_tokens": datasets.Value("int32"),  # before truncation (at least this many when the text was cut)
    "n_trainable": datasets.Value("int32"),  # after truncation, after the causal shift
    "row": datasets.Value("int64"),  # index of the source row (RowNames names it)
})
STATS = ("n_tokens", "n_trainable", "row")


@dataclass
class Layout:
    """How the rows of one source become canonical examples, and how they are named."""

    fmt: str
    rename: dict[str, str]
    fields: dict[str, str]  # message fields `columns:` renames (hftrain's name -> the data's)
    has_template: bool
    roles: dict[str, str]
    key: str
    names: RowNames
    is_json: bool
    path: str

    def rows_of_batch(self, batch: dict, indices: list[int]):
        """(index, where, row) of each row of a map batch (JSON rows parsed; Arrow rows checked for size)."""
        for j, index in enumerate(indices):
            if self.is_json:
                yield index, self.names.of_json(batch[FILE][j], batch[LINE][j]), json.loads(batch[JSON][j])
            else:
                where = self.names.of_index(index)
                row = {c: batch[c][j] for c in batch}
                row_size_problem(row, where, self.key)
                yield index, where, row

    def canonical(self, row: dict, where: str) -> dict:
        return canonical_row(row, self.fmt, self.rename, self.has_template, self.roles, self.key, where,
                             self.fields)


def train_on_prompt(fmt: str, cfg: DataSection, tokenizer, key: str) -> bool:
    """Whether a layout trains on every token (else only on the assistant turns or the completion)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if fmt in ("messages", "sharegpt") and not has_template:
        raise DataError(
            f"{key}: {'messages' if fmt == 'messages' else 'sharegpt conversations'} need a chat template and the "
            "tokenizer has none; set data.chat_template "
            "(a Jinja string or a .jinja file)"
        )
    return {
        "messages": not cfg.assistant_only_loss,
        "sharegpt": not cfg.assistant_only_loss,
        "alpaca": not (cfg.assistant_only_loss if has_template else cfg.completion_only_loss),
        "prompt_completion": not cfg.completion_only_loss,
        "text": True,
    }[fmt]


def layout_of(rows: Rows, src: DataSource, key: str, tokenizer) -> Layout:
    fmt, rename, fields = source_layout(rows, src, key)
    return Layout(fmt=fmt, rename=rename, fields=fields, has_template=bool(getattr(tokenizer, "chat_template", None)),
                  roles=dict(src.roles), key=key, names=rows.names, is_json=rows.is_json, path=src.path)


class RowExamples:
    """The tokenising map function of one source (batched, with_indices): see the module docstring."""

    def __init__(self, layout: Layout, tokenizer, train_on_prompt: bool, chat_template_kwargs: dict | None,
                 max_length: int, truncate: bool, train_turns: str = "all"):
        self.layout, self.tokenizer, self.on_prompt = layout, tokenizer, train_on_prompt
        self.kwargs, self.max_length, self.truncate = chat_template_kwargs, max_length, truncate
        self.train_turns = train_turns
        self._limit: int | None = None

    @property
    def limit(self) -> int:
        if self._limit is None:
            self._limit = char_bound(self.tokenizer, self.max_length)
        return self._limit

    def examples(self, canon: dict, where: str) -> list[dict[str, Any]]:
        """The tokenised examples of one canonical row, cut to max_length when truncating, with their counts."""
        cut, source = bounded(canon, self.limit), f"{self.layout.key} ({where})"
        if cut_changes(canon, cut, self.tokenizer, self.kwargs, self.max_length, self.limit):
            cut = canon
        result = []
        for ex in tokenize_examples(cut, self.tokenizer, self.on_prompt, self.kwargs, source, self.train_turns):
            n = len(ex["input_ids"])
            if self.truncate:
                ex = {k: v[:self.max_length] for k, v in ex.items()}
            result.append({"input_ids": ex["input_ids"], "labels": ex["labels"], "n_tokens": n,
                           "n_trainable": trainable_tokens(ex["labels"])})
        return result

    def of_row(self, row: dict, where: str) -> list[dict[str, Any]]:
        """The examples of one row as read (the streaming pipeline's call, stream.py)."""
        return self.examples(self.layout.canonical(row, where), where)

    def __call__(self, batch: dict, indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {name: [] for name in TOKENISED}
        # Every row of the batch in canonical form first: a row that is wrong as data is named before any is
        # rendered (a template's refusal is the later, rarer kind).
        canon = [(index, where, self.layout.canonical(row, where))
                 for index, where, row in self.layout.rows_of_batch(batch, indices)]
        for index, where, c in canon:
            for ex in self.examples(c, where):
                for name, value in ex.items():
                    out[name].append(value)
                out["row"].append(index)
        return out


def first_problem_rows(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def untrainable_error(key: str, path: str, bad: list[str], count: int, total: int, max_length: int) -> DataError:
    return DataError(
        f"{key}: {count} of {total} examples of {path} have no trainable token ({first_problem_rows(bad)}) "
        f"after masking and truncation to data.max_length={max_length}. Raise data.max_length, "
        "fix those rows, or set data.skip_untrainable: true to drop them"
    )


def row_examples(layout: Layout, tokenizer, cfg: DataSection) -> RowExamples:
    return RowExamples(layout, tokenizer, train_on_prompt(layout.fmt, cfg, tokenizer, layout.key),
                       cfg.chat_template_kwargs, cfg.max_length, truncate=cfg.truncation != "drop",
                       train_turns=cfg.train_turns)
