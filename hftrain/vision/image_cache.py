"""Image rows in the datasets cache: a source's examples (ids, labels, image spans, held-out messages), once read,
checked, rendered and labelled, are kept under `$HF_DATASETS_CACHE/hftrain/images-<key>.json`, so a second run (or
`hftrain data`, or another rank) opens and decodes no image and calls no processor.

The key holds everything that decides the examples: the source's rows (data/sources.py's key: the files' identity,
or a saved dataset's fingerprint), the source's keys (format, columns, roles, split), the processor (its tokenizer's
content, its image processor's settings, data.image_*_pixels among them, its chat template), the data keys the
examples depend on, and the code that makes them (vision/'s modules and data/'s pipeline). The images are files
outside the rows: the entry records each one's path, size and modification time, and an entry whose images are not
all as recorded is read again (an image edited in place, a file replaced). An entry that cannot be written (a
read-only or full cache) is said and the run goes on without it."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

from ..data.cache import cache_folder, code_version, digest, read_meta, tokenizer_fingerprint
from ..distributed import print0
from ..fileio import atomic_write

# The modules whose code decides an image example: their text is part of every key.
VISION_MODULES = ("labels.py", "image_rows.py", "images.py", "image_datasets.py", "image_examples.py",
                  "image_sources.py", "families.py", "image_cache.py")
# The data keys an image example depends on (the processor's settings are in the key whole).
EXAMPLE_KEYS = ("assistant_only_loss", "chat_template_kwargs", "train_turns", "max_length", "truncation",
                "skip_untrainable")


@dataclass
class ReadExamples:
    examples: list[dict]
    layout: str
    too_long: list[str]
    untrainable: list[str]
    images: list[str] = field(default_factory=list)  # every image file the rows name (kept or left out)
    cached: bool = False


@functools.cache
def vision_code_version() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(code_version().encode())
    for name in VISION_MODULES:
        with open(os.path.join(here, name), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def examples_key(rows, src, processor, cfg) -> str:
    return digest(["image-examples", vision_code_version(), rows.key, dataclasses.asdict(src),
                   type(processor).__name__, tokenizer_fingerprint(processor.tokenizer),
                   processor.image_processor.to_json_string(), processor.chat_template,
                   {k: getattr(cfg, k) for k in EXAMPLE_KEYS}])


def identities(paths: list[str]) -> list[list] | None:
    """[path, size, modification time] of each image file, or None when one is gone."""
    out = []
    for path in sorted(set(paths)):
        try:
            st = os.stat(path)
        except OSError:
            return None
        out.append([path, st.st_size, st.st_mtime_ns])
    return out


def cached_examples(rows, src, key: str, processor, cfg, read: Callable[[], ReadExamples]) -> ReadExamples:
    """The source's examples from the cache where an entry of this key holds them and its images are unchanged;
    else read() and the entry written."""
    path = os.path.join(cache_folder(), f"images-{examples_key(rows, src, processor, cfg)}.json")
    entry = read_meta(path)
    if entry is not None and identities([i for i, *_ in entry["images"]]) == entry["images"]:
        return ReadExamples([_example(e) for e in entry["examples"]], entry["layout"], entry["too_long"],
                            entry["untrainable"], [i for i, *_ in entry["images"]], cached=True)
    fresh = read()
    keep(path, key, fresh)
    return fresh


def _example(stored: dict) -> dict:
    return dict(stored, image_spans=[tuple(span) for span in stored["image_spans"]])


def keep(path: str, key: str, read: ReadExamples) -> None:
    """Write the cache entry (atomically); a cache that cannot take it is said, never fatal."""
    entry = {"examples": read.examples, "layout": read.layout, "too_long": read.too_long,
             "untrainable": read.untrainable, "images": identities(read.images)}
    if entry["images"] is None:  # an image went away while it was read: nothing to keep
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, json.dumps(entry))
    except OSError as e:
        print0(f"hftrain: {key}: the image rows were not kept in the datasets cache ({e.strerror or e}); the next run "
               "reads them again", file=sys.stderr)
