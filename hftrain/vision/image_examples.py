"""One image row made one example, for both pipelines (the prepared one, image_datasets.py, and the streaming one,
data/stream.py through `ImageRowExamples.of_row`): the row in canonical form with its images checked (image_rows.py,
images.py), rendered by the processor and labelled (labels.py), counted; a row longer than data.max_length is
refused naming each image's tokens, unless data.truncation: drop leaves it out (image rows are never cut: an image's
tokens cut would not match its pixels)."""

from __future__ import annotations

import os

from ..config import DataSection, DataSource
from ..data.render import trainable_tokens
from ..data.sources import Rows
from ..errors import DataError
from .families import family_of, image_token_ids
from .image_rows import base_folder, canonical_image_row
from .image_sources import image_layout
from .labels import image_example, image_tokens_in

STREAMED = ("input_ids", "labels", "images", "n_tokens", "n_trainable")  # what a streamed example carries


def image_tokens_said(example: dict, processor) -> str:
    """`N of them its images' (FILE: N tokens, ...)`: each image's run of tokens in an example."""
    groups = image_tokens_in(example, image_token_ids(processor)[1])
    each = ", ".join(f"{' and '.join(os.path.basename(example['images'][i]) for i in images)}: {count} tokens"
                     for images, count in groups)
    return f"{sum(count for _, count in groups)} of them its images' ({each})"


def size_fix(processor) -> str:
    """The fix for images too large, where the family's processor takes pixel bounds."""
    return "" if family_of(processor).fixed_size else ", or lower data.image_max_pixels (fewer tokens per image)"


class ImageRowExamples:
    """The row function of one image source (its layout found from its first rows: `of_source`)."""

    def __init__(self, fmt: str, rename: dict[str, str], src: DataSource, key: str, processor, cfg: DataSection):
        self.fmt, self.rename, self.roles, self.base = fmt, rename, dict(src.roles), base_folder(src.path)
        self.key, self.processor, self.cfg = key, processor, cfg

    @classmethod
    def of_source(cls, rows: Rows, src: DataSource, key: str, processor, cfg: DataSection) -> "ImageRowExamples":
        """The row function of a source whose first rows (or all) are `rows` (data/stream.py's RowsReader)."""
        fmt, rename = image_layout(rows, src, key)  # format and columns as the text sources read them
        return cls(fmt, rename, src, key, processor, cfg)

    def example(self, row: dict, where: str) -> dict:
        """{input_ids, labels, images, image_spans, messages, n_tokens, n_trainable} of one row as read."""
        cfg, at = self.cfg, f"{self.key} ({where})"
        canon = canonical_image_row({self.rename.get(k, k): v for k, v in row.items()}, at, self.base, self.fmt,
                                    self.roles)
        example = image_example(canon, self.processor, not cfg.assistant_only_loss, cfg.chat_template_kwargs, at,
                                cfg.train_turns)
        n_tokens = len(example["input_ids"])
        if n_tokens > cfg.max_length and cfg.truncation != "drop":
            raise DataError(f"{at}: {n_tokens} tokens is more than data.max_length={cfg.max_length}, "
                            f"{image_tokens_said(example, self.processor)}, and image rows are never cut (an image's "
                            "tokens cut would not match its pixels); raise data.max_length, set data.truncation: "
                            f"drop{size_fix(self.processor)}")
        return dict(example, messages=canon["messages"], n_tokens=n_tokens,
                    n_trainable=trainable_tokens(example["labels"]))

    def of_row(self, row: dict, where: str) -> list[dict]:
        """The streaming pipeline's call: the row's one example, with what the collator reads and the counts the
        stream drops or refuses it by."""
        example = self.example(row, where)
        return [{k: example[k] for k in STREAMED}]
