"""Batching: padded rows, or packed rows whose examples never attend to each other."""

from __future__ import annotations

import torch
from transformers import DataCollatorForSeq2Seq

from ..constants import IGNORE_INDEX
from ..errors import DataError


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of whole examples in rows of at most `capacity` tokens: first fit, longest first. Order within a row
    is the order of placement."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def packed_tokens(features: list[dict], pad_token_id: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """The packing loop, written once for text rows and image rows (vision/packing.py): ({input_ids, labels,
    position_ids} of `features` packed by pack_rows into rows of the longest example's width, each example's
    positions from 0 and its first token untrained (it follows another example), the padding one more sequence
    without targets; the examples' indices per row, in their order). Labels are the example's own, else its ids."""
    lengths = [len(f["input_ids"]) for f in features]
    width = max(lengths)
    rows = pack_rows(lengths, width)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            f, n = features[i], lengths[i]
            input_ids[r, at:at + n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            labels[r, at + 1:at + n] = torch.as_tensor(f.get("labels", f["input_ids"])[1:], dtype=torch.long)
            position_ids[r, at:at + n] = torch.arange(n)
            at += n
        position_ids[r, at:] = torch.arange(width - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}, rows


def right_padded(rows: list[list[int]], pad_id: int, labels: list[list[int]] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Padding written once ({input_ids, attention_mask} and, given `labels`, labels) of token rows padded on the
    right: pad ids, mask 0, IGNORE_INDEX labels. A decoder numbers positions from a row's first token, and a sequence
    classifier reads its score before the first pad id."""
    width = max(1, *map(len, rows))
    out = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
    if labels is not None:
        out["labels"] = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        out["input_ids"][i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        out["attention_mask"][i, :len(row)] = 1
        if labels is not None:
            out["labels"][i, :len(row)] = torch.as_tensor(labels[i], dtype=torch.long)
    return out


class PackedRows:
    """Packs a batch's examples into rows no longer than its longest example.

    Why not one row (transformers' DataCollatorWithFlattening): with sdpa or eager attention the block-diagonal mask
    of a packed row is a dense (T, T) mask and the kernel computes every block of it, so one row of a whole batch
    costs (sum of lengths)^2 in attention, where padding costs batch x longest^2; on an instruction-like set that
    made packing slower than padding (bench/packing.py). Rows of at most the longest example never cost more than
    the padded batch and hold most of its padding's worth of examples.

    Each row: whole examples, position_ids restarting at 0 for each (the mask built from them is block-diagonal),
    the first label of each example IGNORE_INDEX (no example predicts the next one's first token), then padding at
    the end: pad ids, IGNORE_INDEX labels and position_ids 0, 1, ... of their own, so the padding is one more
    sequence without targets that attends to nothing else. No attention_mask: transformers builds the packed mask
    only without one.
    """

    def __init__(self, pad_token_id: int | None):
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        return packed_tokens(features, self.pad_token_id)[0]


def make_collator(tokenizer, packing: bool):
    if packing:
        return PackedRows(tokenizer.pad_token_id)
    if tokenizer.pad_token_id is None:
        raise DataError(
            "the tokenizer has no pad token; batching without packing needs one (set data.packing: true, or use a "
            "tokenizer with a pad token)"
        )
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
