"""The datasets of a recipe whose model is an image-text-to-text model: every row of every source read, its images
opened and checked (image_rows.py, images.py), rendered by the processor and labelled (labels.py), before the model
loads; held-out rows split as the text pipeline splits them (data/split.py). Rows are kept in memory, not in the
datasets cache; batches padded (image_batches.py) or packed (packing.py); streaming is not done for them yet
(refused by name)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import datasets

from ..config import DataSection, DataSource
from ..data import Datasets, mix, read_rows
from ..data.left_out import say_left_out
from ..data.render import trainable_tokens
from ..data.split import split_rows
from ..distributed import print0
from ..errors import DataError
from .image_answers import image_eval_examples
from .image_batches import ImageRows
from .packing import PackedImageRows
from .families import family_of, image_token_ids
from .labels import image_example, image_tokens_in
from .image_rows import base_folder, canonical_image_row
from .image_cache import ReadExamples, cached_examples
from .image_sources import image_layout


@dataclass
class ImageDatasets(Datasets):
    processor: Any = None  # the trainer's processing class: saved beside the model


def not_yet_problems(cfg: DataSection) -> list[str]:
    out = []
    if cfg.streaming:
        out.append("data.streaming: streaming image rows is not done yet; set data.streaming: false")
    return out


def image_tokens_said(example: dict, processor) -> str:
    """`N of them its images' (FILE: N tokens, ...)`: each image's run of tokens in an example."""
    groups = image_tokens_in(example, image_token_ids(processor)[1])
    each = ", ".join(f"{' and '.join(os.path.basename(example['images'][i]) for i in images)}: {count} tokens"
                     for images, count in groups)
    return f"{sum(count for _, count in groups)} of them its images' ({each})"


def size_fix(processor) -> str:
    """The fix for images too large, where the family's processor takes pixel bounds."""
    return "" if family_of(processor).fixed_size else ", or lower data.image_max_pixels (fewer tokens per image)"


def source_examples(src: DataSource, key: str, processor, cfg: DataSection) -> tuple[list[dict], int]:
    """(every row of one source that trains as an example: input_ids, labels, images, row; the source's rows), each
    row checked; from the datasets cache where this source was read so before (image_cache.py), its images unchanged."""
    rows = read_rows(src, key)
    read = cached_examples(rows, src, key, processor, cfg, lambda: read_examples(rows, src, key, processor, cfg))
    if not read.examples:
        raise DataError(f"{key}: no row of {src.path} trains (too long with data.truncation: drop, or untrainable)")
    print0(f"hftrain: {key} ({src.path}): image rows, layout {read.layout}, {rows.count} rows"
           f"{' (prepared before: the datasets cache)' if read.cached else ''}", file=sys.stderr)
    for left, why, fix in ((read.too_long, f"longer than data.max_length={cfg.max_length} tokens, their images' "
                            "included (data.truncation: drop)", "raise data.max_length to keep them"),
                           (read.untrainable, "no trainable token (data.skip_untrainable)",
                            "give them an assistant turn")):
        say_left_out(key, src.path, left, rows.count, "image rows", why, fix)
    return read.examples, rows.count


def read_examples(rows, src: DataSource, key: str, processor, cfg: DataSection) -> ReadExamples:
    """Every row of a source read, checked (each image opened and decoded), rendered and labelled."""
    fmt, rename = image_layout(rows, src, key)  # format and columns as the text sources read them
    base, out = base_folder(src.path), []
    too_long, untrainable, images = [], [], []
    for index, (where, row) in enumerate(rows.iterate()):
        at = f"{key} ({where})"
        canon = canonical_image_row({rename.get(k, k): v for k, v in row.items()}, at, base, fmt, src.roles)
        images += canon["images"]
        example = image_example(canon, processor, not cfg.assistant_only_loss, cfg.chat_template_kwargs, at,
                                cfg.train_turns)
        if len(example["input_ids"]) > cfg.max_length:
            if cfg.truncation == "drop":
                too_long.append(where)
                continue
            raise DataError(f"{at}: {len(example['input_ids'])} tokens is more than data.max_length={cfg.max_length}, "
                            f"{image_tokens_said(example, processor)}, and image rows are never cut (an image's tokens "
                            "cut would not match its pixels); raise data.max_length, set data.truncation: drop"
                            f"{size_fix(processor)}")
        if trainable_tokens(example["labels"]) == 0:
            if cfg.skip_untrainable:
                untrainable.append(where)
                continue
            raise DataError(f"{at}: the row has no trainable token (no assistant turn); fix it or set "
                            "data.skip_untrainable: true")
        out.append(dict(example, row=index, messages=canon["messages"]))  # messages: held-out answers
    return ReadExamples(out, fmt, too_long, untrainable, images)


def _dataset(examples: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{k: e[k] for k in ("input_ids", "labels", "images")} for e in examples])


def build_image_datasets(cfg: DataSection, processor, seed: int, exact_match: int = 0) -> ImageDatasets:
    """Train and held-out image rows; the first `exact_match` held-out rows also as examples whose answers
    eval.exact_match generates (image_answers.py: the prompt with its images, the reference)."""
    problems = not_yet_problems(cfg)
    if problems:
        raise DataError(problems[0] if len(problems) == 1 else "; ".join(problems))
    train, weights, held = [], [], []
    for i, src in enumerate(cfg.sources):
        key = f"data.sources.{i}"
        examples, count = source_examples(src, key, processor, cfg)
        if cfg.eval_fraction > 0:
            _, out = split_rows(count, cfg.eval_fraction, seed, key, src.path)
            out = set(int(r) for r in out)
            held += [e for e in examples if e["row"] in out]
            examples = [e for e in examples if e["row"] not in out]
        if examples:
            train.append(_dataset(examples))
            weights.append(src.weight)
    for i, src in enumerate(cfg.eval_sources):
        held += source_examples(src, f"data.eval_sources.{i}", processor, cfg)[0]
    collator = PackedImageRows(processor) if cfg.packing else ImageRows(processor)
    train = mix(train, weights, seed) if train else _dataset([])  # weighted as text sources are (data.mix)
    return ImageDatasets(train, _dataset(held) if held else None, collator,
                         image_eval_examples(held, exact_match), processor=processor)
