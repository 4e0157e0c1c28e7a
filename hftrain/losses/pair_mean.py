"""The exact pair mean of a TRL trainer whose batches hold a micro-batch's chosen rows then its rejected rows in
`input_ids` (DPOTrainer, RewardTrainer) and whose loss is the mean over the micro-batch's pairs: each micro-batch's
share of the mean over every pair of the optimizer step's global batch (maths.pair_mean_share). Preference tuning
(methods/preference/dpo.py) and outcome reward models (methods/reward/outcome.py) use it."""

from __future__ import annotations

import torch

from . import maths
from .global_batch import GlobalBatchMixin


class PairMeanMixin(GlobalBatchMixin):
    """The loss as the exact mean over the pairs of the optimizer step's global batch (maths.pair_mean_share), from
    the per-micro-batch mean a TRL trainer returns."""

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The pairs of the optimizer step over every micro-batch and rank (a batch holds chosen then rejected rows)."""
        if not batch_samples or "input_ids" not in batch_samples[0]:
            return None
        return self.global_sum(torch.tensor(sum(b["input_ids"].shape[0] // 2 for b in batch_samples), device=device))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs)
        if not model.training or num_items_in_batch is None:  # eval: the micro-batch's mean, as TRL returns it
            return out
        loss, outputs = out if return_outputs else (out, None)
        loss = maths.pair_mean_share(loss, inputs["input_ids"].shape[0] // 2, num_items_in_batch,
                                     self.data_parallel_size())
        return (loss, outputs) if return_outputs else loss
