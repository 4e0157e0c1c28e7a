"""Building the training and eval datasets of a recipe: every source read into Arrow (sources.py), tokenised by a
cached datasets map (rows.py), checked, split, mixed.

Memory stays flat in the corpus size: rows live in memory-mapped Arrow files of the datasets cache, and the only
per-row arrays held are a few integer columns (lengths, trainable counts, row indices) while choosing the examples.
The tokenised cache is named by a key of the rows' own key (the source files' identity), hftrain's pipeline code,
the tokenizer and every setting that changes an example (data.train_turns among them: a row becomes one example, or
one per assistant turn its template writes differently once later messages follow, and the `row` column names each
example's row, so a held-out row takes all its examples to eval); a warm start finds it by name and memory-maps it. The
preparation runs once per machine, or once per job on a shared filesystem (distributed.once_per_node): the main
process tokenises with data.num_proc workers while the others wait holding no rows, then map the result.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import datasets
import numpy as np

from ..config import DataSection, DataSource
from ..distributed import once_per_node, print0
from ..errors import DataError
from ..fileio import atomic_write
from .cache import (cache_folder, code_version, damaged, digest, in_cache, intact, read_meta, tokenizer_fingerprint,
                    writable_cache)
from .collate import make_collator
from .messages import content_text
from .rows import STATS, TOKENISED, Layout, layout_of, row_examples, untrainable_error
from .sources import Rows, read_rows, read_rows_sample
from .split import split_rows
from .stream import stream_dataset
from .templates import stop_ids

ROWS_PER_WORKER = 5_000  # below this, a worker process costs more than it saves


@dataclass
class Datasets:
    train: Any
    eval: Any | None
    collator: Callable
    eval_examples: list[dict]  # canonical held-out examples (prompt + reference) for generation metrics


@dataclass
class Prepared:
    """One source tokenised: every example of every row, with the STATS columns."""

    key: str
    src: DataSource
    rows: Rows
    layout: Layout
    tokenised: datasets.Dataset
    cache_file: str | None
    counts: dict  # what choose() needs to know whether it must read the columns at all (summary())

    def column(self, name: str) -> np.ndarray:
        return self.tokenised.data.column(name).to_numpy()

    def canonical(self, index: int) -> dict:
        where, row = next(self.rows.iterate_at([index]))
        return self.layout.canonical(row, where)


def workers(cfg: DataSection, rows: int) -> int | None:
    """data.num_proc, or the cores this process may use (at most one per ROWS_PER_WORKER rows); None: no pool."""
    n = cfg.num_proc if cfg.num_proc is not None else min(len(os.sched_getaffinity(0)), rows // ROWS_PER_WORKER)
    return n if n and n > 1 else None


def batch_rows(max_length: int) -> int:
    """Rows per map batch, which is also an Arrow record batch of the cache: as many as ~2M tokens allow (a worker
    holds a batch as Python lists), at least datasets' 1000. Fewer batches, less mapped on a warm start: a reader
    touches every batch's header and the kernel maps its neighbours with it."""
    return max(1000, min(10_000, 2_000_000 // max_length))


def summary(tok: datasets.Dataset, max_length: int) -> dict:
    """The counts choose() decides by, read once from the columns when the examples are made."""
    n_tokens = tok.data.column("n_tokens").to_numpy()
    trainable = tok.data.column("n_trainable").to_numpy()
    return {"examples": len(tok), "too_long": int((n_tokens > max_length).sum()),
            "untrainable": int((trainable == 0).sum()),
            "untrainable_not_too_long": int(((trainable == 0) & (n_tokens <= max_length)).sum())}


def prepare_source(src: DataSource, key: str, tokenizer, cfg: DataSection, tokenizer_key: str | None = None
                   ) -> Prepared:
    """One source read and tokenised into the cache (or found there), every row checked: a bad row stops with a
    DataError naming the key, the file and the row. `tokens-<name>.json`, written last, lists the cache's files
    and counts: a warm start reads it and maps those files, nothing else."""
    rows = read_rows(src, key)
    layout = layout_of(rows, src, key, tokenizer)
    fn = row_examples(layout, tokenizer, cfg)
    name = digest(["tokens", rows.key, code_version(), tokenizer_key or tokenizer_fingerprint(tokenizer), layout.fmt,
                   layout.rename, layout.fields, layout.has_template, layout.roles, fn.on_prompt,
                   cfg.chat_template_kwargs, cfg.train_turns, cfg.max_length, cfg.truncation,
                   # generation_config.json's eos: the token that ends a turn
                   None if tokenizer is None else sorted(stop_ids(tokenizer)[0])])
    folder = cache_folder()
    cache, meta_path = os.path.join(folder, f"tokens-{name}.arrow"), os.path.join(folder, f"tokens-{name}.json")
    meta = read_meta(meta_path)
    tok = _mapped(folder, meta, meta_path) if meta is not None else None
    if tok is None:
        writable_cache(folder, key)
        n = batch_rows(cfg.max_length)
        need = 4 * rows.dataset.data.nbytes  # token ids, labels and counts: a few times the rows' own size
        tok = in_cache(folder, key, need, lambda: rows.dataset.map(
            fn, batched=True, with_indices=True, remove_columns=rows.dataset.column_names, features=TOKENISED,
            batch_size=n, writer_batch_size=n, num_proc=workers(cfg, rows.count), cache_file_name=cache,
            new_fingerprint=name, desc=f"Tokenising {src.path}"))
        files = [os.path.basename(f["filename"]) for f in tok.cache_files]
        meta = {"files": files, "sizes": [os.path.getsize(os.path.join(folder, f)) for f in files],
                "counts": summary(tok, cfg.max_length)}
        atomic_write(meta_path, json.dumps(meta))
    # stderr: `hftrain check` prints the resolved recipe on stdout, as YAML to be read back
    print0(f"hftrain: {key} ({src.path}): layout {layout.fmt}, {rows.count} rows", file=sys.stderr)
    return Prepared(key, src, rows, layout, tok, cache, meta["counts"])


def _mapped(folder: str, meta: dict, meta_path: str) -> datasets.Dataset | None:
    """The cached examples `meta` lists, memory-mapped; None (the files removed, to be prepared again) when one is
    missing, truncated or unreadable: a damaged cache is rebuilt, never a traceback."""
    why = "a file is missing or has another size than when it was written"
    if intact(folder, meta["files"], meta.get("sizes")):
        try:
            parts = [datasets.Dataset.from_file(os.path.join(folder, f)) for f in meta["files"]]
            return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
            why = f"{type(e).__name__}: {e}"
    damaged(folder, [*meta["files"], os.path.basename(meta_path)], why, print0)
    return None


def prepare_sample(src: DataSource, key: str, tokenizer, cfg: DataSection, n: int) -> Prepared:
    """The first n rows of a source tokenised in memory (a streaming source is never prepared whole)."""
    rows = read_rows_sample(src, key, n)
    layout = layout_of(rows, src, key, tokenizer)
    tok = rows.dataset.map(row_examples(layout, tokenizer, cfg), batched=True, with_indices=True,
                           remove_columns=rows.dataset.column_names, features=TOKENISED, keep_in_memory=True)
    return Prepared(key, src, rows, layout, tok, None, summary(tok, cfg.max_length))


def choose(p: Prepared, cfg: DataSection, rows_mask: np.ndarray | None = None) -> datasets.Dataset:
    """The examples of a prepared source that train (of the rows in `rows_mask`): too long ones dropped with
    data.truncation: drop, untrainable ones refused by name, or dropped with data.skip_untrainable."""
    untrainable = p.counts["untrainable_not_too_long" if cfg.truncation == "drop" else "untrainable"]
    if rows_mask is None and untrainable == 0 and (cfg.truncation != "drop" or p.counts["too_long"] == 0):
        return p.tokenised.remove_columns(list(STATS))  # every example trains: no column read
    n_tokens, trainable, row = p.column("n_tokens"), p.column("n_trainable"), p.column("row")
    keep = np.ones(len(row), dtype=bool) if rows_mask is None else rows_mask[row]
    if cfg.truncation == "drop":
        keep &= n_tokens <= cfg.max_length
        if not keep.any():
            raise DataError(f"{p.key}: every example of {p.src.path} is longer than data.max_length={cfg.max_length}; "
                            "raise data.max_length, or set data.truncation: right to cut them")
    bad = np.flatnonzero(keep & (trainable == 0))
    if len(bad):
        if not cfg.skip_untrainable:
            names = [p.rows.where(int(row[i])) for i in bad[:6]]
            raise untrainable_error(p.key, p.src.path, names, len(bad), int(keep.sum()), cfg.max_length)
        keep[bad] = False
        if not keep.any():
            raise DataError(f"{p.key}: no example of {p.src.path} has a trainable token")
    ds = p.tokenised if keep.all() else p.tokenised.select(np.flatnonzero(keep))
    return ds.remove_columns(list(STATS))


def _eval_examples(p: Prepared, rows: np.ndarray, n: int) -> list[dict]:
    """Held-out examples split into what the model sees and the reference answer."""
    out = []
    for index in sorted(int(i) for i in rows)[:max(n, 0)]:
        canon = p.canonical(index)
        if "messages" in canon and canon["messages"] and canon["messages"][-1]["role"] == "assistant":
            out.append({"messages": canon["messages"][:-1],
                        "reference": content_text(canon["messages"][-1]["content"])})
        elif "prompt" in canon:
            out.append({"prompt": canon["prompt"], "reference": canon["completion"]})
    return out


def prepare_all(cfg: DataSection, tokenizer) -> tuple[list[Prepared], list[Prepared]]:
    """Every training and eval source prepared (streaming: the eval sources only); on every rank, the work done once
    per machine (see the module docstring)."""
    def work():
        tokenizer_key = tokenizer_fingerprint(tokenizer)
        train = [] if cfg.streaming else [prepare_source(s, f"data.sources.{i}", tokenizer, cfg, tokenizer_key)
                                          for i, s in enumerate(cfg.sources)]
        held = [prepare_source(s, f"data.eval_sources.{i}", tokenizer, cfg, tokenizer_key)
                for i, s in enumerate(cfg.eval_sources)]
        return train, held

    return once_per_node(work, errors=(DataError,))


def build_datasets(cfg: DataSection, tokenizer, seed: int = 42, exact_match: int = 0) -> Datasets:
    train_sources, eval_sources = prepare_all(cfg, tokenizer)
    train_parts, eval_parts, eval_examples = [], [], []
    for p in train_sources:
        if cfg.eval_fraction > 0:
            _, held = split_rows(p.rows.count, cfg.eval_fraction, seed, p.key, p.src.path)
            mask = np.zeros(p.rows.count, dtype=bool)
            mask[held] = True
            eval_parts.append(choose(p, cfg, mask))
            eval_examples += _eval_examples(p, held, exact_match - len(eval_examples))
            train_parts.append(choose(p, cfg, ~mask))
        else:
            train_parts.append(choose(p, cfg))
    for p in eval_sources:
        eval_parts.append(choose(p, cfg))
        eval_examples += _eval_examples(p, np.arange(p.rows.count), exact_match - len(eval_examples))
    if cfg.streaming:
        train = stream_dataset(cfg, tokenizer, seed)
    else:
        train = mix(train_parts, [s.weight for s in cfg.sources], seed)
    evald = datasets.concatenate_datasets(eval_parts) if eval_parts else None
    return Datasets(train, evald, make_collator(tokenizer, cfg.packing), eval_examples[:exact_match])


def mix(parts: list, weights: list[float], seed: int):
    """One source as is; several interleaved with probabilities proportional to their weights, until every source
    has been seen whole (datasets' `all_exhausted`)."""
    if len(parts) == 1:
        return parts[0]
    total = sum(weights)
    return datasets.interleave_datasets(
        parts, probabilities=[w / total for w in weights], seed=seed, stopping_strategy="all_exhausted"
    )
