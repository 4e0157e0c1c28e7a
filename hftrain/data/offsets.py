"""Token ids with character offsets that cover every character, whatever the tokenizer's offset convention.

A byte-level post-processor that trims offsets (trim_offsets, the tokenizers default: GPT-2's) moves a token's
leading and trailing spaces out of its offsets, and gives a token of spaces zero width: such a token would overlap no
trained span and never be trained ("2 + 3 = 5." trained as "2 +", "3 =", "5."). The offsets therefore come from a
copy of the tokenizer whose post-processor keeps them (tokenizers' own encode, trim_offsets off; the ids are the
same), so the labels are the same with trim_offsets on or off."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

_copies: dict = {}  # key -> (tokenizer, its copy with untrimmed offsets, or None when it never trims)


def _untrim(spec) -> bool:
    """Turn off every trim_offsets of a (JSON) post-processor spec; whether one was on."""
    changed = False
    if isinstance(spec, dict):
        if spec.get("trim_offsets") is True:
            spec["trim_offsets"], changed = False, True
        for value in spec.values():
            changed |= _untrim(value)
    elif isinstance(spec, list):
        for value in spec:
            changed |= _untrim(value)
    return changed


def _untrimmed(tokenizer) -> Tokenizer | None:
    """A copy of the tokenizer's backend whose post-processor does not trim offsets; None when it never does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    key = (id(tokenizer), len(tokenizer), repr(backend.post_processor))
    if _copies.get(key, (None,))[0] is not tokenizer:
        spec = json.loads(backend.to_str())
        copy = Tokenizer.from_str(json.dumps(spec)) if _untrim(spec.get("post_processor")) else None
        _copies[key] = (tokenizer, copy)
    return _copies[key][1]


def encode(tokenizer, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, character offsets of each token, whitespace included)."""
    copy = _untrimmed(tokenizer)
    if copy is not None:
        enc = copy.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]
