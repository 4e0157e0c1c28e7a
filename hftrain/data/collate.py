"""Batching: padded rows, or packed rows whose examples never attend to each other."""

from __future__ import annotations

from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from ..constants import IGNORE_INDEX
from ..errors import DataError


def make_collator(tokenizer, packing: bool):
    if packing:
        # One row per batch, position_ids restarting at 0 for each example: the attention mask built from them
        # is block-diagonal, so packed examples never attend to each other; the first label of each is -100.
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    if tokenizer.pad_token_id is None:
        raise DataError(
            "the tokenizer has no pad token; batching without packing needs one (set data.packing: true, or use a "
            "tokenizer with a pad token)"
        )
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
