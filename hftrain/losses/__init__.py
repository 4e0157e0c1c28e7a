"""The loss, once for every method: token sums, counts and normalisation over the global batch, aux terms (maths.py),
cross-entropy from lm_head's input in chunks without the full logits (chunked_ce.py), and the trainer mixins that use
them: SFT's CE exact over the global batch and its eval loss (exact.py), the per-token CE from logits or chunked
(chunked.py), and what every exact loss asks of its trainer: global counts and a micro-batch's share
(global_batch.py), and the pair mean of TRL's pair trainers (pair_mean.py)."""

from .chunked import ChunkedLossMixin
from .exact import ExactLossMixin
from .global_batch import GlobalBatchMixin
from .pair_mean import PairMeanMixin
from .maths import (
    MODES,
    aligned_ce,
    aligned_hidden_loss_sum,
    aux_loss_term,
    count_targets,
    counts_of,
    eval_loss,
    example_sums,
    hidden_ce,
    hidden_loss_sum,
    loader_shifted,
    loss_sum,
    normalise,
    pair_mean_share,
    segment_ids,
    shifted,
    sum_ce,
    target_ce,
    target_weights,
    weights_of,
)

__all__ = ["ChunkedLossMixin", "ExactLossMixin", "GlobalBatchMixin", "PairMeanMixin", "MODES", "aligned_ce",
           "aligned_hidden_loss_sum", "aux_loss_term", "count_targets", "counts_of", "eval_loss", "example_sums",
           "hidden_ce", "hidden_loss_sum", "loader_shifted", "loss_sum", "normalise", "pair_mean_share", "segment_ids",
           "shifted", "sum_ce", "target_ce", "target_weights", "weights_of"]
