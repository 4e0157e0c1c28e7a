"""Sequence parallelism (strategy.sequence_parallel: N, DeepSpeed's Ulysses): what hftrain adds to DeepSpeed's
sequence splitting (ulysses.py) and what changes in the trainer: loader, attention, loss (mixin.py)."""

from .mixin import SequenceParallelMixin
from .ulysses import (
    DocumentAttention,
    ShardableRows,
    full_rows,
    group,
    heads_problem,
    parallelism_config,
    segments,
    sharded_batches,
    size,
)

__all__ = ["SequenceParallelMixin", "DocumentAttention", "ShardableRows", "full_rows", "group", "heads_problem",
           "parallelism_config", "segments", "sharded_batches", "size"]
