"""Data: sources -> layouts (canonical examples) -> rendered token ids and labels -> datasets -> batches."""

from .build import Datasets, build_datasets, mix, prepare_source
from .collate import make_collator
from .layouts import canonicalise, detect_format, read_canonical, to_messages_or_text
from .render import render_examples, tokenize_example, tokenize_examples, trainable_tokens
from .sources import read_rows

__all__ = ["Datasets", "build_datasets", "prepare_source", "mix", "make_collator", "detect_format", "canonicalise",
           "read_canonical", "to_messages_or_text", "render_examples", "tokenize_example", "tokenize_examples",
           "trainable_tokens", "read_rows"]
