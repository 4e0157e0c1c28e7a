"""The loss maths, once: exact token-level and sequence-level averaging over the global batch, and aux losses.

The quantity hftrain trains on, for one optimizer step, is

    token:    sum over ranks, micro-batches and target tokens of CE  /  global number of target tokens
    sequence: sum over ranks, micro-batches and sequences of (mean CE of the sequence)  /  global number of sequences

Each micro-batch contributes `loss_sum(micro-batch) / global_count * dp_size`: the data-parallel engine (DDP,
FSDP, DeepSpeed) averages gradients over the `dp_size` ranks, which cancels the factor, and the micro-batches of
an accumulation window add up. Nothing is divided by the accumulation steps again.

The eval loss is the mean CE over every target token of the eval set (`eval_loss` of the per-example
`example_sums`), whatever the loss mode, the number of processes or the eval batch size.

A target is a label != -100 after the causal shift (labels[..., 1:]). Sequences are rows, or, in packed rows,
the runs of position_ids that restart at 0.

Under sequence parallelism (hftrain/sequence_parallel/) a rank holds a slice of every row with its labels already
shifted (`shift_labels[:, i] = labels[:, i + 1]`): `loader_shifted` gives the same (targets, sequences) for those,
`aligned_ce` / `aligned_hidden_loss_sum` the CE of every position against its aligned target, and a slice's
`weights_of` come from its whole rows, so that the slices' sums add up to the rows' `loss_sum`.
"""

from __future__ import annotations

from typing import get_args

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX, LossAveraging
from . import fused_ce
from .chunked_ce import HeadMath, linear_ce

MODES = get_args(LossAveraging)


def segment_ids(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) ids, unique over the batch, of the sequence each position belongs to."""
    b, t = labels.shape
    row = torch.arange(b, device=labels.device).unsqueeze(1) * (t + 1)
    if position_ids is None:
        return row.expand(b, t)
    pos = position_ids.expand(b, t) if position_ids.shape[0] != b else position_ids
    starts = (pos == 0).long()
    starts[:, 0] = 1
    return row + starts.cumsum(dim=1)


def shifted(labels: torch.Tensor, position_ids: torch.Tensor | None = None):
    """Targets for positions 0..T-2 and the sequence each belongs to."""
    return labels[:, 1:], segment_ids(labels, position_ids)[:, 1:]


def loader_shifted(shift_labels: torch.Tensor, position_ids: torch.Tensor | None = None):
    """`shifted` for labels a loader already shifted (shift_labels[:, i] = labels[:, i + 1], IGNORE_INDEX last):
    the targets as they are and, for each, the sequence of the token it predicts."""
    seg = segment_ids(shift_labels, position_ids)
    return shift_labels, torch.cat([seg[:, 1:], seg[:, -1:]], dim=1)


def count_targets(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> tuple[int, int]:
    """(target tokens, sequences with at least one target) in one micro-batch."""
    return counts_of(*shifted(labels, position_ids))


def counts_of(targets: torch.Tensor, seg: torch.Tensor) -> tuple[int, int]:
    """`count_targets` of (targets, sequences) from `shifted` or `loader_shifted`."""
    mask = targets != IGNORE_INDEX
    return int(mask.sum()), int(torch.unique(seg[mask]).numel())


def target_ce(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """CE of each position 0..T-2 against its shifted target, flattened; 0 where the target is ignored."""
    return aligned_ce(logits[:, :-1], targets, label_smoothing)


def aligned_ce(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """CE of every position against the target at the same index, flattened; 0 where the target is ignored."""
    logits = logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    )


def hidden_ce(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
              math: HeadMath = HeadMath(), label_smoothing: float = 0.0, chunk_size: int | None = None):
    """`target_ce` from the final hidden states (B, T, H) and the output head, without the full logits
    (chunked_ce.linear_ce): the same flattened CE of each position 0..T-2, 0 where the target is ignored."""
    h = hidden[:, :-1]
    return linear_ce(h.reshape(-1, h.shape[-1]), weight, bias, labels[:, 1:].reshape(-1), math, label_smoothing,
                     chunk_size)


def hidden_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    mode: str = "token", position_ids: torch.Tensor | None = None, math: HeadMath = HeadMath(),
                    label_smoothing: float = 0.0, chunk_size: int | None = None, fused: bool = False) -> torch.Tensor:
    """`loss_sum` from the final hidden states and the output head, without the full logits: sum(w * CE) with
    w = 1 per target (token) or 1 / the sequence's targets (sequence), gradients computed chunk by chunk, or with
    `fused` (training.loss_impl: fused, token average only) by liger-kernel's fused kernel (fused_ce)."""
    if fused:
        return fused_ce.linear_ce_sum(hidden[:, :-1].reshape(-1, hidden.shape[-1]), weight, bias,
                                      labels[:, 1:].reshape(-1), math, label_smoothing)
    weights = target_weights(labels, mode, position_ids)
    return aligned_hidden_loss_sum(hidden[:, :-1], weight, bias, labels[:, 1:], weights, math, label_smoothing,
                                   chunk_size)


def aligned_hidden_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            targets: torch.Tensor, weights: torch.Tensor, math: HeadMath = HeadMath(),
                            label_smoothing: float = 0.0, chunk_size: int | None = None,
                            fused: bool = False) -> torch.Tensor:
    """sum(weights * CE) of every position of `hidden` (B, T, H) against the target at the same index, through the
    output head in chunks (chunked_ce.linear_ce); `weights`: `weights_of`, flattened. With `fused` (the token
    average, so `weights` is 1 at each target) by liger-kernel's fused kernel (fused_ce)."""
    if fused:
        return fused_ce.linear_ce_sum(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1), math,
                                      label_smoothing)
    return linear_ce(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1), math, label_smoothing,
                     chunk_size, row_weights=weights)


def target_weights(labels: torch.Tensor, mode: str = "token", position_ids: torch.Tensor | None = None):
    """(B * (T-1),) fp32 weight of each position's CE in `loss_sum`: 0 where ignored; 1 (token) or 1 / the number
    of targets of its sequence (sequence)."""
    return weights_of(*shifted(labels, position_ids), mode)


def weights_of(targets: torch.Tensor, seg: torch.Tensor, mode: str = "token") -> torch.Tensor:
    """`target_weights` of (targets, sequences) from `shifted` or `loader_shifted`, flattened."""
    mask = (targets != IGNORE_INDEX).reshape(-1).float()
    if mode == "token":
        return mask
    if mode != "sequence":
        raise ValueError(f"loss mode must be one of {MODES}, got {mode!r}")
    _, inverse = torch.unique(seg.reshape(-1), return_inverse=True)
    counts = torch.zeros(int(inverse.max()) + 1, device=mask.device).index_add(0, inverse, mask)
    return mask / counts[inverse].clamp(min=1)


def loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mode: str = "token",
    position_ids: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The micro-batch's share of the numerator: sum of target CE (token) or of per-sequence mean CE (sequence)."""
    return sum_ce(target_ce(logits, labels[:, 1:], label_smoothing), labels, mode, position_ids)


def sum_ce(ce: torch.Tensor, labels: torch.Tensor, mode: str = "token",
           position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`loss_sum` from the flattened per-position CE (`target_ce` or `hidden_ce`)."""
    targets, seg = shifted(labels, position_ids)
    mask = targets.reshape(-1) != IGNORE_INDEX
    if mode == "token":
        return ce[mask].sum()
    if mode != "sequence":
        raise ValueError(f"loss mode must be one of {MODES}, got {mode!r}")
    seg = seg.reshape(-1)[mask]
    _, inverse = torch.unique(seg, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(n, dtype=ce.dtype, device=ce.device).index_add(0, inverse, ce[mask])
    counts = torch.zeros(n, dtype=ce.dtype, device=ce.device).index_add(0, inverse, torch.ones_like(ce[mask]))
    return (sums / counts).sum()


def example_sums(logits: torch.Tensor | None, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                 ce: torch.Tensor | None = None) -> torch.Tensor:
    """(examples, 2) float64, in batch order: each example's CE summed over its targets, and its number of targets.

    One row per example (a padded row, or a packed sequence with targets), so that rows a distributed sampler added
    to fill its last batch can be dropped by position before anything is summed (eval batches are padded, never
    packed: packing reorders examples). `ce`: the flattened per-position CE already computed (`hidden_ce`)."""
    targets, seg = shifted(labels, position_ids)
    ce = (target_ce(logits, targets) if ce is None else ce).double()
    mask = (targets.reshape(-1) != IGNORE_INDEX).double()
    _, example = torch.unique(seg.reshape(-1), return_inverse=True)  # ids increase along the batch
    n = int(example.max()) + 1 if example.numel() else 0
    sums = torch.zeros(n, 2, dtype=torch.float64, device=ce.device)
    sums.index_add_(0, example, torch.stack([ce * mask, mask], dim=1))
    # A packed row's trailing padding is a sequence of its own without targets: not an example.
    return sums[sums[:, 1] > 0] if position_ids is not None else sums


def eval_loss(sums: torch.Tensor) -> float:
    """Mean CE over every target token of the examples of `example_sums` rows (each example once)."""
    total = sums.sum(dim=0)
    return float(total[0] / total[1]) if float(total[1]) > 0 else float("nan")


def normalise(loss_sum_: torch.Tensor, global_count: torch.Tensor | int, dp_size: int) -> torch.Tensor:
    """What a micro-batch returns for backward (see the module docstring)."""
    return loss_sum_ / global_count * dp_size


def aux_loss_term(aux: torch.Tensor, coef: float, accumulation_steps: int) -> torch.Tensor:
    """Term to add to a micro-batch's normalised loss so that the step's gradient is
    `coef * grad(mean of aux over every micro-batch of every rank)`, whatever the world size and accumulation.

    Why: each micro-batch's term is summed over the accumulation window and averaged over the dp ranks, so
    dividing by the accumulation steps leaves the mean over all micro-batches. (An aux loss added inside the
    model's forward instead rides on the main loss and is multiplied by the dp size.)
    """
    return coef * aux / accumulation_steps


def pair_mean_share(micro_mean: torch.Tensor, local_pairs: int, global_pairs: torch.Tensor | int,
                    dp_size: int) -> torch.Tensor:
    """A micro-batch's share of the preference loss, the mean over every pair of the optimizer step's global batch.

    A preference loss (TRL's DPO, IPO, ...) returns the mean over the micro-batch's pairs; the Trainer would divide
    it by the accumulation steps and DDP average it over ranks, a mean of means that is the global mean only when
    every micro-batch holds as many pairs (not at the end of an epoch, nor with a partial last window). The mean
    times its pairs is the micro-batch's sum; over the global count and times dp_size (DDP's average cancels it)
    the micro-batches of every rank add up to the exact global mean, as `normalise` does for tokens."""
    return normalise(micro_mean * local_pairs, global_pairs, dp_size)
