"""Where prepared data lives (the datasets cache, under hftrain/) and how its files are named: by a key of
everything that decides their content, so that a warm start finds them by name and reads nothing else."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Callable

import datasets
from datasets.fingerprint import Hasher

from ..errors import DataError
from ..fileio import free_bytes, is_no_space

# The modules whose code decides what a prepared example holds: their text is part of every key, so a change of
# hftrain's reading, layouts or rendering is never served from an older cache.
PIPELINE_MODULES = ("jsonrows.py", "sources.py", "layouts.py", "render.py", "templates.py", "turns.py", "forms.py",
                    "offsets.py", "cut.py", "rows.py")


ENTRY_PREFIXES = ("tokens-", "rows-")  # the names of hftrain's cache entries (build.py, sources.py)


def cache_folder() -> str:
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "hftrain")


def writable_cache(folder: str, key: str) -> None:
    """The cache folder exists and takes new files, or a DataError naming it and the fix (a cold cache that cannot be
    written ended in a traceback from deep inside datasets)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hftrain-write-test-"):
            pass
    except OSError as e:
        raise DataError(f"{key}: the datasets cache {folder} cannot be written ({e.strerror or e}) and holds no "
                        "prepared copy of this source: make it writable, or point HF_DATASETS_CACHE at a writable "
                        "folder") from None


def intact(folder: str, files: list[str], sizes: list[int] | None) -> bool:
    """The cache's files are all there at the sizes written (a truncated or deleted file: prepared again)."""
    paths = [os.path.join(folder, f) for f in files]
    if not all(os.path.isfile(p) for p in paths):
        return False
    return sizes is None or [os.path.getsize(p) for p in paths] == list(sizes)


def read_meta(path: str) -> dict | None:
    """A cache entry's meta file (written last, atomically), or None when there is none or it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("files", []), list) else None


def damaged(folder: str, names: list[str], why: str, say=print) -> None:
    """Remove a damaged cache entry's files (its meta file first), saying so: it is prepared again."""
    say(f"hftrain: the cached {os.path.splitext(names[-1])[0]} in {folder} is damaged ({why}): preparing it again",
        file=sys.stderr)
    for name in names:  # only cache entries' own names in the folder (a meta file could list anything)
        if os.path.basename(name) != name or not name.startswith(ENTRY_PREFIXES):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's fingerprint, not the folder it was loaded from: datasets' Hasher of the tokenizer itself pickles
    its `name_or_path`, so a model copied or moved to another folder tokenised every source again."""
    if tokenizer is None:
        return Hasher.hash(None)
    bare = copy.copy(tokenizer)  # shallow: the two fields are replaced on the copy, the tokenizer is not edited
    bare.name_or_path = ""
    bare.init_kwargs = {k: v for k, v in tokenizer.init_kwargs.items() if k != "name_or_path"}
    return Hasher.hash(bare)


@functools.cache
def code_version() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in PIPELINE_MODULES:
        with open(os.path.join(here, name), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def in_cache(folder: str, key: str, need: int, work: Callable):
    """work() (writing files under `folder`: datasets' map, the JSON reader), with a full disk told clearly: the
    temporary files left (datasets writes `tmp*` beside the cache file and renames it when done, as the JSON reader
    does; on an error the partial file stays) are removed, and the error names the folder, the free space, a rough
    need (`need`: bytes of the rows read) and where else to put the cache. Not a context manager: its __exit__
    would keep the failed writer (and its open file) alive while the files are removed, and a deleted open file
    keeps its space."""
    start, free = time.time() - 1, None
    before = _temporaries(folder)
    try:
        return work()
    except Exception as e:
        free = free_bytes(folder)
        if not is_no_space(e, free):
            raise
    gc.collect()  # the failed writer's frames, released with the exception: closes its file
    with contextlib.suppress(OSError):
        for name in _temporaries(folder) - before:  # the ones this call's writers made (new, and written since)
            path = os.path.join(folder, name)
            if os.path.isfile(path) and os.path.getmtime(path) >= start:
                os.remove(path)
    raise DataError(f"{key}: no space left in the datasets cache {folder} ({(free or 0) >> 10} KiB free; the "
                    f"prepared data needs roughly {max(need >> 20, 1)} MiB): free space there, or point "
                    "HF_DATASETS_CACHE at a larger disk")


def _temporaries(folder: str) -> set[str]:
    """The names of the temporary files in the cache folder (datasets' `tmp*`, the JSON reader's `tmp-<pid>-*`)."""
    try:
        return {name for name in os.listdir(folder) if name.startswith("tmp")}
    except OSError:
        return set()
