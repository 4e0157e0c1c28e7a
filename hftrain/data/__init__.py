"""Data: sources -> layouts (canonical examples) -> rendered token ids and labels -> datasets -> batches."""

from .build import Datasets, build_datasets, mix
from .collate import make_collator
from .layouts import detect_format, prepare_columns, to_messages_or_text
from .render import render, tokenize_example, trainable_tokens
from .sources import load_source

__all__ = ["Datasets", "build_datasets", "mix", "make_collator", "detect_format", "prepare_columns",
           "to_messages_or_text", "render", "tokenize_example", "trainable_tokens", "load_source"]
