"""Sequence parallelism (strategy.sequence_parallel: N) in the trainer: each rank of a group of N holds a slice of
every sequence of the group's batch (ulysses.py says what DeepSpeed's Ulysses does and what hftrain
adds). What changes here:

- the train loader: batches Ulysses can split (`ShardableRows`), its adapter made resumable (`ShardedBatches`);
- attention: per example in packed rows, and the model's own mask outside training (`DocumentAttention`);
- the loss: a slice's labels come shifted by the loader (`shift_labels`), so each position's CE is taken against
  the target at its own index; its weights (1 per target, or 1 / its sequence's targets) come from the whole rows,
  and the step's counts are global over every rank, each target once (a rank counts its slice's targets; the
  sequences of a row are counted by the first rank of the group). ExactLossMixin's normalisation is unchanged:
  the slices' sums add up to the rows' `loss_sum`, and ZeRO averages the gradients over every rank.

Evaluation is not split: each rank evaluates its own examples whole, as without sequence parallelism (accelerate
registers Ulysses with disable_in_eval), so eval_loss and exact match are those of ExactLossMixin and evaluate.py.
"""

from __future__ import annotations

import torch

from .. import losses
from ..constants import IGNORE_INDEX
from ..data.collate import PackedRows
from ..errors import ModelError
from . import ulysses as sp


class SequenceParallelMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sp_size = sp.size(self.args)
        self._attention = None
        if self.sp_size > 1:
            if not self.is_deepspeed_enabled:
                raise ModelError("sequence parallelism (the arguments' parallelism_config) runs on DeepSpeed's "
                                 "Ulysses: use a ZeRO strategy (strategy.name: zero2 or zero3)")
            self._attention = sp.DocumentAttention(self.args.parallelism_config.sp_handler.sp_attn_implementation)

    # -- data ------------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        if self.sp_size == 1:
            return super().get_train_dataloader()
        pad = getattr(self.processing_class, "pad_token_id", None)
        inner, self.data_collator = self.data_collator, sp.ShardableRows(
            pad, self.sp_size, self.args.per_device_train_batch_size, packed=isinstance(self.data_collator, PackedRows))
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = inner

    def train(self, *args, **kwargs):
        """Training with Ulysses around the attention kernel; after it the kernel alone again (what evaluate() and
        generation after training use, and any other model of this process)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._attention is not None:
                self._attention.uninstall()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """super() prepares the engine, where accelerate registers Ulysses around the attention kernel it finds (the
        per-example one installed first), and wraps the train loader in DeepSpeed's adapter (made ShardedBatches)."""
        if self.sp_size == 1:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self._attention.ulysses is not None:
            raise RuntimeError("train() runs once per trainer under sequence parallelism (Ulysses is registered when "
                               "the engine is first prepared); build a new trainer")
        self._attention.install()
        try:
            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader,
                                                                    resume_from_checkpoint)
        except BaseException:
            self._attention.uninstall()
            raise
        self._attention.dispatch_after_prepare()
        return model, sp.sharded_batches(train_dataloader, getattr(self.processing_class, "pad_token_id", None))

    # -- counts and loss (ExactLossMixin's hooks) --------------------------------------------------------------
    def _batch_counts(self, batch: dict, device: torch.device):
        if "shift_labels" not in batch:
            return super()._batch_counts(batch, device)
        targets = batch["shift_labels"]
        tokens = int((targets != IGNORE_INDEX).sum())
        if self.args.loss_averaging == "token":
            return tokens, 0
        rows = losses.loader_shifted(sp.full_rows(targets, device), sp.full_rows(batch["position_ids"], device))
        first = sp.group()[1] == 0  # a sequence may span the slices: the group's first rank counts the rows'
        return tokens, losses.counts_of(*rows)[1] if first else 0

    def _loss_sum(self, model, inputs: dict, mode: str):
        if "shift_labels" not in inputs:
            return super()._loss_sum(model, inputs, mode)
        targets = inputs.pop("shift_labels")
        if mode == "token":
            weights = (targets != IGNORE_INDEX).reshape(-1).float()
        else:  # 1 / its sequence's targets over the whole row: this slice's part of the row's weights
            device = targets.device
            whole = losses.loader_shifted(sp.full_rows(targets, device), sp.full_rows(inputs["position_ids"], device))
            _, rank, _ = sp.group()
            width = targets.shape[1]
            weights = losses.weights_of(*whole, mode).reshape(whole[0].shape)[:, rank * width:(rank + 1) * width]
            weights = weights.reshape(-1)
        return self._aligned_loss_sum(model, inputs, targets, weights, self.args.label_smoothing_factor)
