"""Reading a data source: local files (.jsonl, .json, .parquet, .csv), a save_to_disk folder, or a Hub id, with
errors that name the source, the file and the row."""

from __future__ import annotations

import glob
import json
import os

import datasets

from ..config import DataSource
from ..errors import DataError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _where(key: str, src: DataSource) -> str:
    return f"{key} ({src.path})"


def load_source(src: DataSource, key: str):
    """A `datasets.Dataset` for one source: local file(s), a save_to_disk folder, or a Hub id."""
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
            return ds
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if os.path.isfile(path) else [])
        if files:
            exts = {os.path.splitext(f)[1].lower() for f in files}
            if len(exts) != 1 or next(iter(exts)) not in FILE_BUILDERS:
                raise DataError(
                    f"{key}.path: cannot read {path}: use .jsonl, .json, .parquet or .csv files (found {sorted(exts)})"
                )
            for f in files:
                if os.path.getsize(f) == 0:
                    raise DataError(f"{key}.path: {f} is empty; fill it or remove this source")
            _check_utf8_json_lines(files, key)
            return datasets.load_dataset(FILE_BUILDERS[exts.pop()], data_files=files, split="train")
        if looks_local or os.path.isdir(path):
            if os.path.isdir(path):
                return datasets.load_dataset(path, name=src.name, split=src.split)
            raise DataError(f"{key}.path: {path} does not exist (a local path; check the spelling or the working directory)")
        return datasets.load_dataset(path, name=src.name, split=src.split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; say which source failed and why
        raise DataError(f"{key}.path: cannot load {path}: {type(e).__name__}: {e}") from e


def _check_utf8_json_lines(files: list[str], key: str) -> None:
    """Name the file and line of a malformed JSONL row or a non-UTF-8 byte (datasets' own error names neither)."""
    for f in files:
        if not f.lower().endswith(".jsonl"):
            continue
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{key}.path: {f}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{key}.path: {f}:{n}: malformed JSON: {e.msg} (column {e.colno})") from None


