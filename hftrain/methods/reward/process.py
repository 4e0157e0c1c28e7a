"""Process reward models: a token classifier with two labels (0: the step is wrong, 1: it is right) scores each
reasoning step at the token that ends it (the step separator: step_rows.py), trained on stepwise-supervision rows.
TRL 1.16 no longer ships the PRMTrainer that did this (removed upstream), so the trainer is hftrain's own: transformers'
Trainer with hftrain's run mixins and, written here because no library has them for this head:

- the loss, the exact mean cross-entropy over the labelled steps of the optimizer step's global batch: each
  micro-batch's CE sum over its labelled positions, over their count summed over every micro-batch and rank
  (losses.GlobalBatchMixin: global_sum, step_share). transformers' token-classification loss is the micro-batch's
  mean, which the Trainer and DDP would average again (a mean of means that weighs steps unequally);
- the held-out step accuracy and F1 of the positive (correct-step) class over every labelled step of every rank
  (gather_for_metrics of per-row counts, which leaves out the rows the last batches repeat), and the held-out loss
  as the exact mean over those steps: eval_step_accuracy, eval_step_f1, eval_loss.

Rows are padded on the right: a decoder numbers positions from a row's first token, so left padding would change a
row's scores with the longest row of its batch. Dropout is off (TRL's PRMConfig did the same by default: a token
classifier's head adds dropout 0.1 of its own). With model.lora peft's TOKEN_CLS task type trains and saves the
classification head whole (modules_to_save)."""

from __future__ import annotations

import torch
from transformers import Trainer
from trl.trainer.utils import disable_dropout_in_model, pad

from ...config import HFTrainingArguments
from ...heads import Head, Role
from ...losses import GlobalBatchMixin, aligned_ce
from ...modeling import load_model
from ...trainer import RUN_MIXINS
from .. import registry
from ..base import Method, ModelSpec
from .figures import step_figures
from .step_rows import IGNORED, read_step_rows, show_steps

HEAD = Head.TOKEN_CLASSIFICATION
LABELS = {0: "incorrect_step", 1: "correct_step"}  # the classes of each step's end token


class RightPadded:
    """A batch of step rows: input_ids padded on the right with the tokenizer's pad token, labels with -100."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict:
        ids = [torch.tensor(r["input_ids"]) for r in rows]
        return {"input_ids": pad(ids, self.pad_token_id, padding_side="right"),
                "attention_mask": pad([torch.ones_like(i) for i in ids], 0, padding_side="right"),
                "labels": pad([torch.tensor(r["labels"]) for r in rows], IGNORED, padding_side="right")}


class StepMeanMixin(GlobalBatchMixin):
    """The loss as the exact mean over the labelled steps of the optimizer step's global batch."""

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The labelled steps of the optimizer step over every micro-batch and rank."""
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        local = sum(int((b["labels"] != IGNORED).sum()) for b in batch_samples)
        return self.global_sum(torch.tensor(local, device=device)).clamp(min=1)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        ce = aligned_ce(outputs.logits, labels).view(labels.shape)  # 0 where the label is -100
        if model.training and num_items_in_batch is not None:
            loss = self.step_share(ce.sum(), num_items_in_batch)
        else:  # evaluation, or a path that did not count: this micro-batch's mean
            loss = ce.sum() / (labels != IGNORED).sum().clamp(min=1)
            self.record_steps(outputs.logits.detach(), labels, ce.detach())
        return (loss, outputs) if return_outputs else loss

    def record_steps(self, logits: torch.Tensor, labels: torch.Tensor, ce: torch.Tensor) -> None:
        """StepMetricsMixin's hook: nothing to record outside an evaluation."""


class StepMetricsMixin:
    """Held-out step accuracy, F1 of the correct-step class and the exact mean loss over every labelled step of
    every rank: each evaluated row's counts gathered (gather_for_metrics), summed after the loop."""

    _labelled_step_tallies: list | None = None

    def record_steps(self, logits, labels, ce):
        if self._labelled_step_tallies is None:
            return
        labelled, predicted = labels != IGNORED, logits.argmax(-1)
        right, wrong = labels == 1, labels == 0
        per_row = torch.stack([ce.float().sum(1), labelled.sum(1), ((predicted == labels) & labelled).sum(1),
                               ((predicted == 1) & right).sum(1), ((predicted == 1) & wrong).sum(1),
                               ((predicted != 1) & right).sum(1)], dim=1).double()
        self._labelled_step_tallies.append(self.accelerator.gather_for_metrics(per_row).cpu())

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._labelled_step_tallies = []
        try:  # the loss only: the per-token logits are read here, not collected by the Trainer
            output = super().evaluation_loop(dataloader, description, True, ignore_keys, metric_key_prefix)
        finally:
            counts, self._labelled_step_tallies = self._labelled_step_tallies, None
        if counts:
            loss, steps, correct, tp, fp, fn = torch.cat(counts).sum(0).tolist()
            output.metrics[f"{metric_key_prefix}_loss"] = loss / steps if steps else float("nan")
            accuracy, f1 = step_figures(steps, correct, tp, fp, fn)
            output.metrics[f"{metric_key_prefix}_step_accuracy"] = accuracy
            output.metrics[f"{metric_key_prefix}_step_f1"] = f1
            output.metrics[f"{metric_key_prefix}_steps"] = int(steps)
        return output


class ProcessRewardTrainer(*RUN_MIXINS, StepMetricsMixin, StepMeanMixin, Trainer):
    """transformers' Trainer with hftrain's checkpoints, guards and compression, the exact step mean and the held-out
    step metrics; `args` is config.HFTrainingArguments."""


class ProcessRewardMethod(Method):
    """A process reward model in the run: a token classifier with two labels as the policy."""

    reported = ("eval_step_accuracy", "eval_step_f1", "eval_loss", "eval_steps")

    def models(self, recipe):
        return [ModelSpec(Role.POLICY, HEAD, recipe.model, num_labels=len(LABELS))]

    def model(self, run):
        policy = self.policy(run.recipe)
        model = load_model(policy.section, head=policy.head, num_labels=policy.num_labels)  # model.lora: TOKEN_CLS
        model.config.id2label, model.config.label2id = dict(LABELS), {v: k for k, v in LABELS.items()}
        disable_dropout_in_model(model)
        return model

    def describe(self, recipe):
        r = recipe.reward
        last = ", the last step's label only" if r.train_on_last_step_only else ""
        return f"process reward modelling (a correct/incorrect score per step at separator {r.step_separator!r}{last})"

    def trainer(self, run, model, tokenizer, data, callbacks):
        return self.trainer_class(model=model, args=run.args, train_dataset=data.train, eval_dataset=data.eval,
                                  processing_class=tokenizer, data_collator=RightPadded(tokenizer.pad_token_id),
                                  callbacks=callbacks)


METHOD = ProcessRewardMethod(
    entry=registry.PROCESS_REWARD, read=read_step_rows, unit="step rows", show=show_steps,
    arguments=lambda recipe, **kwargs: HFTrainingArguments(**kwargs), trainer_class=ProcessRewardTrainer,
    hub_tag="process-reward-model")
