"""Held-out rows split off a source (data.eval_fraction), by datasets' train_test_split: what it refuses (a fraction
that leaves no training row, or no held-out row) is the user's to fix, said with the key and the source."""

from __future__ import annotations

from ..errors import DataError


def held_out_split(ds, fraction: float, seed: int, key: str, path: str):
    """(train, held out) of one source's rows; a DataError naming data.eval_fraction, the source and its row count
    where datasets refuses the split (its ValueError, e.g. 2 rows at 0.9 leave an empty training set)."""
    try:
        split = ds.train_test_split(test_size=fraction, seed=seed)
    except ValueError as e:
        raise DataError(f"data.eval_fraction: {fraction} of the {len(ds)} rows of {key} ({path}) cannot be split "
                        f"({' '.join(str(e).split())}); lower data.eval_fraction, add rows, or hold out rows with "
                        "data.eval_sources instead") from None
    return split["train"], split["test"]
