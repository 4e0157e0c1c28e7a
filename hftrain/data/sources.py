"""Reading a data source: local files (.jsonl, .json, .parquet, .csv, or a glob or folder of one kind), a
save_to_disk folder or a Hub id, as a memory-mapped Arrow dataset in the datasets cache, never as Python lists of
the whole corpus.

JSON and JSON lines are read a row at a time (jsonrows.py) into `rows-<key>.arrow`: each row's own JSON text and
its place (file index, line or array index). The key is the files' identity (path, size, modification time and a
hash of their first and last 64 KiB) and the reader's version, so an unchanged file is never read again and a
changed one always is. Parquet, CSV, saved and Hub datasets are Arrow already: datasets reads and caches them.

Each row's place is kept as two numbers and named in the user's own numbering only when a message needs it, so
that an error found later (after renaming, shuffling or an eval_fraction split) still points at the row to fix:
`file.jsonl:12` (line, 1-based), `file.json index 3` (0-based position in the array), `file.parquet row 7` (0-based),
`folder row 7`.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import datasets
from datasets.arrow_writer import ArrowWriter
from datasets.data_files import DataFilesDict, get_data_patterns

from ..config import DataSource
from ..distributed import print0
from ..errors import DataError
from ..fileio import atomic_write
from .cache import cache_folder, damaged, digest, in_cache, intact, read_meta, writable_cache
from .jsonrows import ROW_LIMIT, array_rows, is_array_file, line_rows, only_whitespace, too_large

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
READER_VERSION = "2"  # bump when what rows-<key>.arrow holds changes
JSON, FILE, LINE = "json", "file", "line"  # the columns of a JSON source's rows
WRITE_BATCH_BYTES = 64 << 20
HEAD_TAIL = 64 << 10


@dataclass
class RowNames:
    """Names rows in the user's numbering: JSON rows by (file index, line or array index); Arrow rows by their
    index in the concatenated parts."""

    parts: list[str]
    arrays: list[bool] = field(default_factory=list)  # JSON: the file holds an array (rows named by index)
    offsets: list[int] = field(default_factory=list)  # Arrow: first index of each part

    def of_json(self, file: int, number: int) -> str:
        return f"{self.parts[file]} index {number}" if self.arrays[file] else f"{self.parts[file]}:{number}"

    def of_index(self, index: int) -> str:
        part = bisect.bisect_right(self.offsets, index) - 1
        return f"{self.parts[part]} row {index - self.offsets[part]}"


@dataclass
class Rows:
    """A source as read: its columns (first seen first) and each part's (the mixed-layout check names files), its
    rows memory-mapped, how to name them, and a key that changes whenever the rows do. A JSON source's rows file is
    opened only when its rows are read (`dataset`): a warm start that finds the tokenised examples never maps it."""

    columns: list[str]
    count: int
    source: datasets.Dataset | Callable[[], datasets.Dataset]  # JSON: columns json/file/line; Arrow: the source's
    names: RowNames
    is_json: bool
    key: str
    part_columns: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def dataset(self) -> datasets.Dataset:
        if callable(self.source):
            self.source = self.source()
        return self.source

    def where(self, index: int) -> str:
        if self.is_json:
            return self.names.of_json(self.dataset[index][FILE], self.dataset[index][LINE])
        return self.names.of_index(index)

    def iterate_at(self, indices) -> Iterator[tuple[str, dict]]:
        """(where, row) of the rows at these indices."""
        for index in indices:
            r = self.dataset[int(index)]
            if self.is_json:
                yield self.names.of_json(r[FILE], r[LINE]), json.loads(r[JSON])
            else:
                yield self.names.of_index(int(index)), r

    def iterate(self, stop: int | None = None) -> Iterator[tuple[str, dict]]:
        """(where, row) of the first `stop` rows (all by default), parsed one at a time."""
        n = self.count if stop is None else min(stop, self.count)
        for start in range(0, n, 1000):
            batch = self.dataset[start:min(start + 1000, n)]
            for j in range(len(next(iter(batch.values())))):
                if self.is_json:
                    yield self.names.of_json(batch[FILE][j], batch[LINE][j]), json.loads(batch[JSON][j])
                else:
                    yield self.names.of_index(start + j), {c: batch[c][j] for c in batch}


def column_map(rows: Rows, src: DataSource, key: str) -> dict[str, str]:
    """The source's `columns:` as a map from the file's column names to hftrain's; a mapped column the file lacks
    is a DataError naming it."""
    rename = {theirs: ours for ours, theirs in src.columns.items()}
    missing = [c for c in rename if c not in rows.columns]
    if missing:
        raise DataError(f"{key}.columns: {missing} not in {src.path} (columns: {rows.columns})")
    return rename


def row_size_problem(row: dict, where: str, key: str) -> None:
    """The size cap JSON lines have, for rows read by Arrow (parquet, CSV, saved and Hub datasets)."""
    size, stack = 0, [row]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            size += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    if size > ROW_LIMIT:
        raise too_large(where, key)


def _is_saved(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                       for f in ("dataset_info.json", "dataset_dict.json"))


def data_files(src: DataSource, key: str) -> tuple[str, list[str]]:
    """(how the source is read: 'files' | 'saved' | 'hub', its local data files); a missing, empty or mixed set of
    files is a DataError naming them."""
    path = os.path.expanduser(src.path)
    looks_local = src.path.startswith((".", "/", "~")) or os.path.splitext(path)[1].lower() in FILE_BUILDERS
    if _is_saved(path):
        return "saved", []
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
    elif os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):  # a folder of data files: its split's files, as datasets' folder loading names them
        try:
            by_split = DataFilesDict.from_local_or_remote(get_data_patterns(path), base_path=path)
        except Exception as e:  # datasets raises EmptyDatasetError and others: name the folder
            raise DataError(f"{key}.path: no data files in the folder {path} ({type(e).__name__})") from None
        if src.split not in by_split:
            raise DataError(f"{key}.split: '{src.split}' not in {path} (splits: {', '.join(map(str, by_split))})")
        files = sorted(by_split[src.split])
    elif looks_local:
        raise DataError(f"{key}.path: {path} does not exist (a local path; check the spelling or the working "
                        "directory)")
    else:
        return "hub", []
    if not files:
        raise DataError(f"{key}.path: no file matches {path}")
    exts = {}
    for f in files:
        exts.setdefault(os.path.splitext(f)[1].lower(), []).append(os.path.basename(f))
    if len(exts) != 1 or next(iter(exts)) not in FILE_BUILDERS:
        found = "; ".join(f"{e or '(none)'}: {', '.join(n[:3])}{' ...' if len(n) > 3 else ''}" for e, n in exts.items())
        raise DataError(f"{key}.path: cannot read {path}: use .jsonl, .json, .parquet or .csv files, one kind per "
                        f"source (found {found})")
    for f in files:
        if os.path.getsize(f) == 0 or only_whitespace(f):
            what = "empty" if os.path.getsize(f) == 0 else "empty (only blanks)"
            raise DataError(f"{key}.path: {f} is {what}; fill it or remove this source")
    return "files", files


def file_identity(path: str) -> list:
    """What changes when a file's rows do: its path, size, modification time and first and last 64 KiB."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(HEAD_TAIL))
        if st.st_size > 2 * HEAD_TAIL:
            fh.seek(-HEAD_TAIL, os.SEEK_END)
            h.update(fh.read(HEAD_TAIL))
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, h.hexdigest()]


def read_rows(src: DataSource, key: str) -> Rows:
    """The rows of one source, memory-mapped (JSON sources read into the cache on first use)."""
    how, files = data_files(src, key)
    path = os.path.expanduser(src.path)
    if how == "files" and FILE_BUILDERS[os.path.splitext(files[0])[1].lower()] == "json":
        return _json_rows(files, key)
    try:
        if how == "saved":
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise DataError(f"{key}.split: '{src.split}' not in {path} (splits: {', '.join(ds)})")
                ds = ds[src.split]
            parts = [(path, ds)]
        elif how == "files":
            builder = FILE_BUILDERS[os.path.splitext(files[0])[1].lower()]
            parts = [(f, datasets.load_dataset(builder, data_files=[f], split="train")) for f in files]
        else:
            parts = [(path, datasets.load_dataset(path, name=src.name, split=src.split))]
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; say which source failed and why
        raise DataError(f"{key}.path: cannot load {path}: {type(e).__name__}: {e}") from e
    return _arrow_rows(parts)


def read_rows_sample(src: DataSource, key: str, n: int) -> Rows:
    """The first n rows of a source (its first files first), in memory: what streaming checks before training."""
    how, files = data_files(src, key)
    path = os.path.expanduser(src.path)
    if how == "files" and FILE_BUILDERS[os.path.splitext(files[0])[1].lower()] == "json":
        batch, arrays, part_columns = {JSON: [], FILE: [], LINE: []}, [], []
        for i, f in enumerate(files):
            arrays.append(is_array_file(f))
            if len(batch[JSON]) >= n:
                part_columns.append([])
                continue
            columns: dict[str, None] = {}
            for number, text, item in (array_rows if arrays[-1] else line_rows)(f, key):
                columns.update(dict.fromkeys(item))
                batch[JSON].append(text)
                batch[FILE].append(i)
                batch[LINE].append(number)
                if len(batch[JSON]) >= n:
                    break
            part_columns.append(list(columns))
        ds = datasets.Dataset.from_dict(batch)
        return Rows(columns=list(dict.fromkeys(c for cols in part_columns for c in cols)), count=len(ds), source=ds,
                    names=RowNames(files, arrays=arrays), is_json=True, key="sample",
                    part_columns=list(zip(files, part_columns)))
    try:
        if how == "saved":
            ds = datasets.load_from_disk(path)
            ds = ds[src.split] if isinstance(ds, datasets.DatasetDict) else ds
            ds = ds.select(range(min(n, len(ds))))
        else:
            stream = (datasets.load_dataset(FILE_BUILDERS[os.path.splitext(files[0])[1].lower()], data_files=files,
                                            split="train", streaming=True) if how == "files"
                      else datasets.load_dataset(path, name=src.name, split=src.split, streaming=True))
            ds = datasets.Dataset.from_list(list(stream.take(n)))
    except Exception as e:  # datasets raises many types; say which source failed and why
        raise DataError(f"{key}.path: cannot stream {path}: {type(e).__name__}: {e}") from e
    return _arrow_rows([(path, ds)])


def _arrow_rows(parts: list[tuple[str, datasets.Dataset]]) -> Rows:
    """Rows of datasets read by Arrow (parquet, csv, saved or Hub datasets), named `<file or folder> row <i>`; their
    key is that of datasets' own cache files (which datasets renews when the source changes)."""
    offsets, n = [], 0
    for _, ds in parts:
        offsets.append(n)
        n += len(ds)
    ds = parts[0][1] if len(parts) == 1 else datasets.concatenate_datasets([d for _, d in parts])
    files = [[c["filename"], *os.stat(c["filename"])[6:9:2]] for _, d in parts for c in d.cache_files]
    key = digest(["arrow", READER_VERSION, files or [d._fingerprint for _, d in parts]])
    return Rows(columns=list(dict.fromkeys(c for _, d in parts for c in d.column_names)), count=n, source=ds,
                names=RowNames([p for p, _ in parts], offsets=offsets), is_json=False, key=key,
                part_columns=[(p, d.column_names) for p, d in parts])


def _json_rows(files: list[str], key: str) -> Rows:
    """JSON sources in the cache: read once per content (see the module docstring), memory-mapped after."""
    rows_key = digest(["json", READER_VERSION, [file_identity(f) for f in files]])
    folder = cache_folder()
    arrow, meta_path = os.path.join(folder, f"rows-{rows_key}.arrow"), os.path.join(folder, f"rows-{rows_key}.json")
    meta = read_meta(meta_path)
    if meta is not None and not intact(folder, [os.path.basename(arrow)], meta.get("sizes")):
        damaged(folder, [os.path.basename(arrow), os.path.basename(meta_path)],
                "the rows file is missing or has another size than when it was written", print0)
        meta = None
    if meta is None:
        writable_cache(folder, key)
        meta = in_cache(folder, key, sum(os.path.getsize(f) for f in files),
                        lambda: _write_json_rows(files, key, arrow))
        meta["sizes"] = [os.path.getsize(arrow)]
        atomic_write(meta_path, json.dumps(meta))
    return Rows(columns=meta["columns"], count=meta["count"], source=lambda: datasets.Dataset.from_file(arrow),
                names=RowNames(files, arrays=meta["arrays"]), is_json=True, key=rows_key,
                part_columns=list(zip(files, meta["part_columns"])))


def _write_json_rows(files: list[str], key: str, arrow: str) -> dict:
    """Every row of the files into `arrow` (a temporary file renamed when complete); what the meta file records."""
    features = datasets.Features({JSON: datasets.Value("large_string"), FILE: datasets.Value("int32"),
                                  LINE: datasets.Value("int64")})
    tmp = os.path.join(os.path.dirname(arrow), f"tmp-{os.getpid()}-{os.path.basename(arrow)}")
    arrays, part_columns, count = [], [], 0
    try:
        # Record batches of up to 10000 rows (WRITE_BATCH_BYTES at most): every batch's header is a page a reader
        # touches, and the kernel maps its neighbours with it (fault-around), so fewer batches, less resident memory
        with ArrowWriter(features=features, path=tmp, writer_batch_size=10_000) as writer:
            batch, size = {JSON: [], FILE: [], LINE: []}, 0
            for i, f in enumerate(files):
                array = is_array_file(f)
                arrays.append(array)
                columns: dict[str, None] = {}
                for number, text, item in (array_rows if array else line_rows)(f, key):
                    columns.update(dict.fromkeys(item))
                    batch[JSON].append(text)
                    batch[FILE].append(i)
                    batch[LINE].append(number)
                    size += len(text)
                    count += 1
                    if size > WRITE_BATCH_BYTES or len(batch[JSON]) >= 10_000:
                        writer.write_batch(batch)
                        batch, size = {JSON: [], FILE: [], LINE: []}, 0
                part_columns.append(list(columns))
            if batch[JSON]:
                writer.write_batch(batch)
            writer.finalize()
        os.replace(tmp, arrow)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"columns": list(dict.fromkeys(c for cols in part_columns for c in cols)), "arrays": arrays,
            "part_columns": part_columns, "count": count}
