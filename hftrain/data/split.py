"""Held-out rows split off a source (data.eval_fraction), one rule for every method: SFT's examples (data/build.py),
and the rows of every other method, through the one loop over the sources (source_loop.py: pairs, KTO's examples, GRPO's
prompts). The rows are drawn as datasets' train_test_split draws them (the first ceil(fraction x n)
of numpy's default_rng(seed) permutation are held out), and a fraction that leaves no training row, or no held-out
row, is the user's to fix, said with the key and the source."""

from __future__ import annotations

import numpy as np

from ..errors import DataError


def split_rows(n: int, fraction: float, seed: int, key: str, path: str) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) of a source of `n` rows, each in the permutation's order."""
    n_test = int(np.ceil(fraction * n))
    if n_test == 0 or n_test == n:
        raise DataError(f"data.eval_fraction: {fraction} of the {n} rows of {key} ({path}) leaves "
                        f"{'no row to hold out' if n_test == 0 else 'no row to train on'}; change "
                        "data.eval_fraction or add rows")
    permutation = np.random.default_rng(seed).permutation(n)
    return permutation[n_test:], permutation[:n_test]


def held_out_split(ds, fraction: float, seed: int, key: str, path: str):
    """(train, held out) of one source's rows (a datasets.Dataset), by split_rows."""
    train, held = split_rows(len(ds), fraction, seed, key, path)
    return ds.select(train), ds.select(held)
