"""The exact loss of supervised fine-tuning: the CE summed over the step's target tokens (or sequences), divided by
their count over every micro-batch and rank, plus registered aux terms; and the exact eval loss.

Why by hand: `compute_loss_func` receives neither position_ids (packed sequence averaging needs them) nor a way to
count sequences, and the Trainer multiplies its result by the world size only in some branches. Overrides:
- `_get_num_items_in_batch`: the step's target tokens and sequences over all micro-batches and ranks (one gather);
- `compute_loss`: `losses.loss_sum / global count * dp_size` (losses.normalise) plus `aux_losses`, each scaled by
  losses.aux_loss_term;
- `evaluation_loop` / `prediction_step`: eval_loss = mean CE over every target token of the eval set, each example
  once (per-example sums through `gather_for_metrics`, which drops the rows the sampler repeated to fill its last
  batch), whatever the number of processes, the eval batch size or the strategy.
Needs ChunkedLossMixin's `_ce` / `_forward` below it.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..data.collate import PackedRows, make_collator
from . import maths as losses
from .global_batch import GlobalBatchMixin


class ExactLossMixin(GlobalBatchMixin):
    def __init__(self, *args, **kwargs):
        # name -> (fn(outputs) -> scalar tensor, coefficient); see losses.aux_loss_term (MoeMixin registers some)
        self.aux_losses: dict[str, tuple[Callable, float]] = {}
        self._counts_since_log: list[tuple[int, int]] = []  # (targets, sequences) of each step since the last log
        self._last_counts: tuple[int, int] | None = None
        self._aux_logged: dict[str, list[float]] = {}
        self._eval_sums: list[torch.Tensor] = []  # per-example (CE sum, targets) of the evaluation in progress
        super().__init__(*args, **kwargs)

    # -- counting --------------------------------------------------------------------------------------------
    def _batch_counts(self, batch: dict, device: torch.device) -> tuple[int, int] | None:
        """(target tokens, sequences) this rank contributes to the step's global counts; None: a batch without
        labels (nothing to count)."""
        if "labels" not in batch:
            return None
        return losses.count_targets(batch["labels"], batch.get("position_ids"))

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        counts = [self._batch_counts(b, device) for b in batch_samples]
        if not counts or counts[0] is None:
            return None
        local = torch.zeros(2, dtype=torch.long, device=device)
        for tokens, seqs in counts:
            local += torch.tensor([tokens, seqs], device=device)
        total = self.global_sum(local)
        self._last_counts = (int(total[0]), int(total[1]))
        count = total[0] if self.args.loss_averaging == "token" else total[1]
        return count.clamp(min=1)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One optimizer step's micro-batches (training only): remember the step's global counts for logging."""
        self._last_counts = None
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._last_counts is not None:
            self._counts_since_log.append(self._last_counts)
        return batch_samples, num_items

    # -- loss ------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        mode = self.args.loss_averaging
        if num_items_in_batch is None:  # a path that did not count (e.g. a direct call): this batch alone
            tokens, seqs = self._batch_counts(inputs, self.args.device)
            num_items_in_batch = max(tokens if mode == "token" else seqs, 1)
        outputs, loss_sum = self._loss_sum(model, inputs, mode)
        total = self.step_share(loss_sum, num_items_in_batch)
        if model.training:
            for name, (fn, coef) in self.aux_losses.items():
                aux = fn(outputs)
                total = total + losses.aux_loss_term(aux, coef, self.current_gradient_accumulation_steps)
                self._aux_logged.setdefault(name, []).append(float(aux.detach()))
        return (total, outputs) if return_outputs else total

    def _loss_sum(self, model, inputs: dict, mode: str):
        """(outputs, losses.loss_sum of this micro-batch); `inputs` loses its labels (none reach the model)."""
        labels = inputs.pop("labels")
        return self._ce(model, inputs, labels, mode, self.args.label_smoothing_factor)

    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs:  # a training log (every rank logs it): the step's global counts and aux terms
            if self._counts_since_log:
                tokens = [c[0] for c in self._counts_since_log]
                logs["target_tokens_per_step"] = sum(tokens) / len(tokens)
                if self.args.loss_averaging == "sequence":
                    logs["sequences_per_step"] = sum(c[1] for c in self._counts_since_log) / len(self._counts_since_log)
                self._counts_since_log.clear()
            for name, values in self._aux_logged.items():
                logs[name] = sum(values) / len(values)
            self._aux_logged.clear()
        super().log(logs, start_time)

    # -- evaluation ------------------------------------------------------------------------------------------
    def get_eval_dataloader(self, eval_dataset=None):
        """Eval batches are padded, never packed: `prediction_step` needs one row per example in the sampler's order
        (packing reorders examples and adds padding sequences), so that the sampler's repeats are dropped by
        position and every rank gathers as many rows. Per-example losses are the same either way (tested)."""
        packed = self.data_collator
        if isinstance(packed, PackedRows):
            padded = make_collator(self.processing_class, packing=False)
        else:  # another packing collator names its padded twin (vision.packing.PackedImageRows)
            padded = getattr(packed, "padded", None)
        if padded is None:
            return super().get_eval_dataloader(eval_dataset)
        self.data_collator = padded
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = packed

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """super()'s loop (model preparation, batches, callbacks) with `prediction_step` collecting per-example
        sums; the Trainer's own eval loss (a mean of per-batch means, the padded repeats included) is replaced."""
        self._eval_sums = []
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if self._eval_sums:
            output.metrics[f"{metric_key_prefix}_loss"] = losses.eval_loss(torch.cat(self._eval_sums))
        self._eval_sums = []
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if inputs.get("labels") is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            # Nothing reads the logits (no metrics over them): the eval loss in chunks too, and no logits returned.
            chunked = self._head is not None and (prediction_loss_only or self.compute_metrics is None
                                                  and self.preprocess_logits_for_metrics is None)
            if chunked:
                logits, ce = None, self._ce(model, inputs, inputs["labels"])[1]
            else:
                logits, ce = self._forward(model, inputs).logits, None
        sums = losses.example_sums(logits, inputs["labels"], inputs.get("position_ids"), ce=ce)
        # Every rank gathers the same number of rows; at the end of the eval set the rows beyond its length (the
        # sampler's repeats of its first examples) are dropped.
        self._eval_sums.append(self.accelerator.gather_for_metrics(sums).cpu())
        if prediction_loss_only or logits is None:
            return None, None, None
        return None, logits.detach(), inputs["labels"]
