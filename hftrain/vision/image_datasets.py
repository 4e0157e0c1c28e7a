"""The datasets of a recipe whose model is an image-text-to-text model: every row of every source read, its images
opened and checked (image_rows.py, images.py), rendered by the processor and labelled (labels.py: one row, one
example, image_examples.py), before the model loads, and kept in the datasets cache (image_cache.py); held-out rows
split as the text pipeline splits them (data/split.py); batches padded (image_batches.py) or packed (packing.py).
With data.streaming the training rows are read as training goes instead (data/stream.py, its position exact on
resume, given image_examples.py's row function); held-out rows come from data.eval_sources, prepared."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import datasets

from ..config import DataSection, DataSource
from ..data import Datasets, mix, read_rows
from ..data.left_out import say_left_out
from ..data.split import split_rows
from ..data.stream import stream_dataset
from ..distributed import print0
from ..errors import DataError
from .image_answers import image_eval_examples
from .image_batches import ImageRows
from .image_cache import ReadExamples, cached_examples
from .image_examples import ImageRowExamples
from .packing import PackedImageRows


@dataclass
class ImageDatasets(Datasets):
    processor: Any = None  # the trainer's processing class: saved beside the model


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
    fn = ImageRowExamples.of_source(rows, src, key, processor, cfg)
    out, too_long, untrainable, images = [], [], [], []
    for index, (where, row) in enumerate(rows.iterate()):
        example = fn.example(row, where)
        images += example["images"]
        if example["n_tokens"] > cfg.max_length:  # data.truncation: drop (else refused by fn.example)
            too_long.append(where)
            continue
        if example["n_trainable"] == 0:
            if cfg.skip_untrainable:
                untrainable.append(where)
                continue
            raise DataError(f"{key} ({where}): the row has no trainable token (no assistant turn); fix it or set "
                            "data.skip_untrainable: true")
        out.append(dict(example, row=index))  # messages: held-out answers
    return ReadExamples(out, fn.fmt, too_long, untrainable, images)


def _dataset(examples: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{k: e[k] for k in ("input_ids", "labels", "images")} for e in examples])


def prepared_train(cfg: DataSection, processor, seed: int) -> tuple[datasets.Dataset, list[dict]]:
    """(the training examples of every source, mixed by weight; the rows data.eval_fraction holds out)."""
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
    return (mix(train, weights, seed) if train else _dataset([])), held  # weighted as text sources are (data.mix)


def build_image_datasets(cfg: DataSection, processor, seed: int, exact_match: int = 0) -> ImageDatasets:
    """Train and held-out image rows; the first `exact_match` held-out rows also as examples whose answers
    eval.exact_match generates (image_answers.py: the prompt with its images, the reference)."""
    if cfg.streaming:  # nothing held out of a stream (config/data_rules.py): data.eval_sources only
        train, held = stream_dataset(cfg, processor, seed, ImageRowExamples.of_source), []
    else:
        train, held = prepared_train(cfg, processor, seed)
    for i, src in enumerate(cfg.eval_sources):
        held += source_examples(src, f"data.eval_sources.{i}", processor, cfg)[0]
    collator = PackedImageRows(processor) if cfg.packing else ImageRows(processor)
    return ImageDatasets(train, _dataset(held) if held else None, collator,
                         image_eval_examples(held, exact_match), processor=processor)
