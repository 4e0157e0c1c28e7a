"""What an image recipe trains on, shown (`hftrain data RECIPE` when the model is image-text-to-text): every row of
every source read and checked as the run reads it (image_datasets.source_examples: each image opened, each row
rendered by the processor and labelled), per-source statistics with the image tokens counted, and the first examples
as the model sees them: trained tokens between [[ and ]] as for text (data/preview.py), each image's run of tokens
shown as one placeholder naming the image, its size and its token count (never trained)."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from ..config import DataSection
from ..constants import IGNORE_INDEX
from ..data.preview import CLOSE, OPEN, marked
from ..data.sources import read_rows_sample
from ..data.stream import CHECK_ROWS
from ..errors import DataError
from .families import image_token_ids
from .image_datasets import read_examples, source_examples
from .labels import image_tokens_in


def _described(path: str, k: int) -> str:
    with Image.open(path) as image:
        width, height = image.size
    return f"image {k}: {os.path.basename(path)} {width}x{height}"


def shown_with_images(tokenizer, example: dict, image_token_id: int) -> str:
    """The example's text with trained tokens marked and each image's expansion (its tokens, and the family's own
    around them) as `<image K: FILE WxH, N tokens>` (images side by side share one: `<image 0: ..., image 1: ...,
    N tokens>`)."""
    ids, labels = example["input_ids"], example["labels"]
    parts, at = [], 0
    for (start, end, first, count), (images, tokens) in zip(example["image_spans"],
                                                            image_tokens_in(example, image_token_id)):
        parts.append(marked(tokenizer, ids[at:start], labels[at:start]))
        parts.append(f"<{', '.join(_described(example['images'][k], k) for k in images)}, {tokens} tokens>")
        at = end
    parts.append(marked(tokenizer, ids[at:], labels[at:]))
    return "".join(parts)


def shown_examples(key: str, src, processor, cfg: DataSection) -> tuple[list[dict], int, str]:
    """(the examples the report counts, the rows they come from, which rows those are): every row, or a streamed
    training source's first rows (as the run checks it before training: data/stream.py; never prepared whole)."""
    if cfg.streaming and key.startswith("data.sources."):
        sample = read_rows_sample(src, key, CHECK_ROWS)
        read = read_examples(sample, src, key, processor, cfg)
        if not read.examples:  # as source_examples refuses a source of which no row trains
            raise DataError(f"{key}: no row of the first {sample.count} rows of {src.path} trains (too long with "
                            "data.truncation: drop, or untrainable)")
        return read.examples, sample.count, f"the first {sample.count} rows (streaming: never prepared whole)"
    examples, rows = source_examples(src, key, processor, cfg)
    return examples, rows, f"{rows} rows"


def image_source_report(key: str, src, processor, cfg: DataSection, shown: int) -> list[str]:
    """Lines about one image source: rows, images, tokens (image tokens counted apart), the first examples."""
    examples, rows, which = shown_examples(key, src, processor, cfg)
    image_id = image_token_ids(processor)[1]
    lengths = np.array([len(e["input_ids"]) for e in examples])
    image_tokens = np.array([sum(t == image_id for t in e["input_ids"]) for e in examples])
    trained = np.array([sum(lab != IGNORE_INDEX for lab in e["labels"]) for e in examples])
    images = sum(len(e["images"]) for e in examples)
    lines = [f"{key} ({src.path}): image rows, {which} -> {len(examples)} examples, {images} images",
             f"  tokens per example (image tokens included): min {lengths.min()}, median {np.median(lengths):g}, "
             f"max {lengths.max()}; image tokens: total {int(image_tokens.sum())}, per example min "
             f"{image_tokens.min()}, max {image_tokens.max()} (never trained)",
             f"  trained tokens per example: mean {trained.mean():.1f}, total {int(trained.sum())}; rows left out: "
             f"{rows - len(examples)} (longer than data.max_length={cfg.max_length} with data.truncation: drop, or "
             "untrainable with data.skip_untrainable; image rows are never cut)"]
    for e in examples[:shown]:
        lines += [f"  --- row {e['row']}: {len(e['input_ids'])} tokens ({sum(t == image_id for t in e['input_ids'])} "
                  f"image tokens), {sum(lab != IGNORE_INDEX for lab in e['labels'])} trained ({OPEN}trained{CLOSE})",
                  shown_with_images(processor.tokenizer, e, image_id)]
    return lines


def image_preview(cfg: DataSection, processor, examples: int = 2) -> str:
    """The report of every training and eval source of an image recipe's data section."""
    sources = [(f"data.sources.{i}", s) for i, s in enumerate(cfg.sources)]
    sources += [(f"data.eval_sources.{i}", s) for i, s in enumerate(cfg.eval_sources)]
    return "\n".join(line for key, src in sources
                     for line in image_source_report(key, src, processor, cfg, examples))
