"""Reading a data source: local files (.jsonl, .json, .parquet, .csv, or a glob of one kind), a save_to_disk folder, a
folder of data files or a Hub id, as rows that each carry where they came from.

Each row's place is kept as text in the user's own numbering, so that an error found later (after renaming,
shuffling or an eval_fraction split) still points at the row to fix: `file.jsonl:12` (line, 1-based), `file.json
index 3` (0-based position in the array), `file.parquet row 7` (0-based), `folder row 7`. JSON and JSONL are
parsed here with Python's json rather than by Arrow, which would merge the keys of every row's tool arguments
into one struct (filling the others with nulls) and refuses a column that is text in one row and a list in
another before a row can be named.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import datasets

from ..config import DataSource
from ..errors import DataError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Rows:
    """A source as read: its column names (first seen first), its size, and its (where, row) pairs."""

    columns: list[str]
    count: int
    iterate: Callable[[], Iterator[tuple[str, dict]]]


def column_map(rows: Rows, src: DataSource, key: str) -> dict[str, str]:
    """The source's `columns:` as a map from the file's column names to hftrain's; a mapped column the file lacks
    is a DataError naming it."""
    rename = {theirs: ours for ours, theirs in src.columns.items()}
    missing = [c for c in rename if c not in rows.columns]
    if missing:
        raise DataError(f"{key}.columns: {missing} not in {src.path} (columns: {rows.columns})")
    return rename


def read_rows(src: DataSource, key: str) -> Rows:
    """The rows of one source: local file(s), a save_to_disk folder, a folder of data files, or a Hub id."""
    path = src.path
    looks_local = path.startswith((".", "/", "~")) or os.path.splitext(path)[1].lower() in FILE_BUILDERS
    path = os.path.expanduser(path)
    try:
        if os.path.isdir(path) and (
            os.path.exists(os.path.join(path, "dataset_info.json"))
            or os.path.exists(os.path.join(path, "dataset_dict.json"))
        ):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise DataError(f"{key}.split: '{src.split}' not in {path} (splits: {', '.join(ds)})")
                ds = ds[src.split]
            return _arrow_rows([(path, ds)])
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if os.path.isfile(path) else [])
        if files:
            return _file_rows(files, path, key)
        if looks_local and not os.path.isdir(path):
            raise DataError(f"{key}.path: {path} does not exist (a local path; check the spelling or the working directory)")
        return _arrow_rows([(path, datasets.load_dataset(path, name=src.name, split=src.split))])
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; say which source failed and why
        raise DataError(f"{key}.path: cannot load {path}: {type(e).__name__}: {e}") from e


def _file_rows(files: list[str], path: str, key: str) -> Rows:
    exts = {os.path.splitext(f)[1].lower() for f in files}
    if len(exts) != 1 or next(iter(exts)) not in FILE_BUILDERS:
        raise DataError(
            f"{key}.path: cannot read {path}: use .jsonl, .json, .parquet or .csv files (found {sorted(exts)})"
        )
    for f in files:
        if os.path.getsize(f) == 0:
            raise DataError(f"{key}.path: {f} is empty; fill it or remove this source")
    builder = FILE_BUILDERS[exts.pop()]
    if builder != "json":
        return _arrow_rows([(f, datasets.load_dataset(builder, data_files=[f], split="train")) for f in files])
    rows = [r for f in files for r in _json_rows(f, key)]
    columns = list(dict.fromkeys(k for _, row in rows for k in row))
    return Rows(columns, len(rows), lambda: iter(rows))


LINE_LIMIT = 8 << 20  # bytes: one JSON line (an example is cut at data.max_length tokens anyway)


def _json_rows(f: str, key: str) -> list[tuple[str, dict]]:
    """A .json file holding an array of objects (rows named by index), or JSON lines (rows named by line), read a
    line at a time: a line longer than LINE_LIMIT is refused after reading LINE_LIMIT bytes of it, not loaded."""
    with open(f, "rb") as fh:
        head = fh.read(4096)
    if f.lower().endswith(".json") and head.lstrip().startswith(b"["):
        with open(f, "rb") as fh:
            items = _parse(fh.read(), f, key, 1)
        return [(f"{f} index {i}", _object(item, f"{f} index {i}", key)) for i, item in enumerate(items)]
    out = []
    with open(f, "rb") as fh:
        for n, line in enumerate(iter(lambda: fh.readline(LINE_LIMIT + 1), b""), 1):
            if len(line) > LINE_LIMIT and not line.endswith(b"\n"):
                raise DataError(f"{key}.path: {f}:{n}: a line of more than {LINE_LIMIT >> 20} MiB; hftrain reads rows "
                                "of up to that size (an example is cut at data.max_length tokens): split the document "
                                "into several rows")
            if line.strip():
                item = _parse(line.rstrip(b"\r\n"), f, key, n)
                out.append((f"{f}:{n}", _object(item, f"{f}:{n}", key)))
    return out


def _parse(raw: bytes, f: str, key: str, first_line: int):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        raise DataError(f"{key}.path: {f}:{line}: not UTF-8 ({e.reason} at byte {e.start}); save the file as "
                        "UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{key}.path: {f}:{first_line + e.lineno - 1}: malformed JSON: {e.msg} (column {e.colno})"
                        ) from None


def _object(item, where: str, key: str) -> dict:
    if not isinstance(item, dict):
        raise DataError(f"{key}: {where}: a row must be a JSON object of named columns, got {type(item).__name__} "
                        f"{json.dumps(item)[:80]}; write each row as {{\"messages\": [...]}}, {{\"text\": ...}}, ...")
    return item


def _arrow_rows(parts: list[tuple[str, datasets.Dataset]]) -> Rows:
    """Rows of datasets read by Arrow (parquet, csv, saved or Hub datasets), named `<file or folder> row <i>`."""
    columns = list(dict.fromkeys(c for _, ds in parts for c in ds.column_names))

    def iterate():
        for name, ds in parts:
            for i, row in enumerate(ds):
                yield f"{name} row {i}", row

    return Rows(columns, sum(len(ds) for _, ds in parts), iterate)
