"""The distillation trainer: SFT's trainer (transformers' Trainer, hftrain's run mixins, the exact loss over the global
batch: losses.ExactLossMixin) whose micro-batch loss sum is the divergence to the teacher over every completion token
(divergence.py, in chunks of tokens), plus distill.ce_weight x their cross-entropy; ExactLossMixin divides it by the
step's completion tokens over every micro-batch and rank (GlobalBatchMixin.step_share), so 2 ranks x GA2 train as 1
rank x GA4.

on_policy: before the step's tokens are counted, the rows GKD's lambda picks (per row, whatever rank and micro-batch
holds it: on_policy.py, which says where this differs from TRL's GKDTrainer) are made the student's own samples for
their prompts (each row's tokens before its first completion token), so the count is of the sampled tokens.

The teacher is frozen (Method.load_frozen), never in the optimizer, and placed as the student's strategy places the
student (methods/frozen.py: FrozenModelsMixin): under ZeRO-3 a DeepSpeed inference engine partitioning it across the
ranks, under FSDP2 sharded per layer as accelerate shards the student (gathered a unit at a time for its forward),
under DDP whole on each rank."""

from __future__ import annotations

import torch

from ...constants import IGNORE_INDEX
from ...distributed import print0
from ...losses import target_ce
from ..frozen import FrozenModelsMixin
from ..sft import SFTTrainer
from .divergence import DivergenceSpec, divergence_sum, token_divergences
from .distill_section import TEACHER_KEY, DistillSection
from .on_policy import on_policy_step
from .teacher_checks import shared_vocab


class DistillTrainer(FrozenModelsMixin, SFTTrainer):
    def __init__(self, *args, teacher, section: DistillSection, **kwargs):
        self.section = section
        self.spec = DivergenceSpec(section.resolved_divergence, section.value("beta"), section.temperature,
                                   section.top_k)
        self.ce_weight = section.value("ce_weight") if section.mode == "logits" else 0.0
        super().__init__(*args, frozen={TEACHER_KEY: teacher}, **kwargs)  # placed as the student (FrozenModelsMixin)
        self.vocab = self._compared_vocab(teacher)
        self.teacher = self.frozen[TEACHER_KEY]

    def _chunked_head(self, loss_impl: str):
        """No chunked CE head: the divergence reads the student's logits (and is chunked over tokens itself)."""
        print0(f"hftrain: loss: {self.spec.kind} to the teacher over the completion tokens, in chunks of tokens"
               + (f", + {self.ce_weight} x cross-entropy" if self.ce_weight else "") + ", / the global batch's "
               "completion tokens")
        return None

    def _compared_vocab(self, teacher_model) -> int:
        student = self.accelerator.unwrap_model(self.model).config.vocab_size
        teacher, size = teacher_model.config.vocab_size, len(self.processing_class)
        shared = shared_vocab(student, teacher, size)
        if shared is None:  # teacher_problems refuses it before loading; a model changed since is refused here
            raise ValueError(f"distill.teacher: vocabulary size {teacher} against the student's {student}, the "
                             f"tokenizer has {size} tokens: not padding only")
        if student != teacher:
            print0(f"hftrain: distill.teacher: vocabulary sizes differ only by padding (student {student}, teacher "
                   f"{teacher}): both distributions are compared over the tokenizer's {shared} tokens")
        return shared

    def _teacher_logits(self, inputs: dict) -> torch.Tensor:
        with torch.no_grad():
            return self.teacher(**{k: v for k, v in inputs.items() if k != "labels"}).logits

    def _pairs(self, student_logits, teacher_logits, labels):
        """The student's and teacher's logits at the positions that predict a completion token, [tokens, vocab]
        each, and each token's row."""
        mask = labels[:, 1:] != IGNORE_INDEX
        rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(mask)[mask]
        return (student_logits[:, :-1][mask][:, :self.vocab], teacher_logits[:, :-1][mask][:, :self.vocab], rows)

    def _loss_sum(self, model, inputs: dict, mode: str):
        """(outputs, this micro-batch's sum over its completion tokens of divergence + ce_weight x CE)."""
        labels = inputs.pop("labels")
        outputs = self._forward(model, inputs)
        student, teacher, _ = self._pairs(outputs.logits, self._teacher_logits(inputs), labels)
        total = divergence_sum(student, teacher, self.spec, self.loss_chunk_size)
        if self.ce_weight:
            total = total + self.ce_weight * target_ce(outputs.logits, labels[:, 1:]).sum()
        return outputs, total

    # -- evaluation: the divergence it trains on is the eval loss (as TRL's GKDTrainer reports it) --------------------
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """The exact loop's (losses.exact), with `<prefix>_loss` the divergence to the teacher per completion token
        of the eval set (each row once, over every rank) and the student's cross-entropy kept as `<prefix>_ce`: what
        metric_for_best_model, early stopping and the curves follow is what the run trains on."""
        self._eval_divergences = []
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if self._eval_divergences:
            total = torch.cat(self._eval_divergences).sum(0)
            output.metrics[f"{metric_key_prefix}_ce"] = output.metrics.get(f"{metric_key_prefix}_loss")
            output.metrics[f"{metric_key_prefix}_loss"] = float(total[0] / total[1].clamp(min=1))
        self._eval_divergences = []
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        out = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if inputs.get("labels") is not None:  # eval rows are padded, one per example (losses.exact)
            rows = self.row_divergences(model, self._prepare_inputs(inputs))
            self._eval_divergences.append(self.accelerator.gather_for_metrics(rows).cpu())
        return out

    @torch.no_grad()
    def row_divergences(self, model, inputs: dict) -> torch.Tensor:
        """[rows, 2]: each row's divergence sum over its completion tokens and their count (held-out metrics)."""
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        student, teacher, rows = self._pairs(self._forward(model, inputs).logits, self._teacher_logits(inputs),
                                             labels)
        out = torch.zeros(labels.shape[0], 2, device=labels.device, dtype=torch.float32)
        out[:, 0].index_add_(0, rows, token_divergences(student, teacher, self.spec, self.loss_chunk_size))
        out[:, 1].index_add_(0, rows, torch.ones_like(rows, dtype=torch.float32))
        return out

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """on_policy: the step's micro-batches replaced (in the step's list) by `_on_policy`'s before the step's
        completion tokens are counted (the Trainer calls this once per step, in training, on every rank)."""
        if self.section.mode == "on_policy" and batch_samples:
            batch_samples[:] = self._on_policy(batch_samples)
        return super()._get_num_items_in_batch(batch_samples, device)

    def _on_policy(self, batch_samples: list) -> list:
        """The micro-batches with the rows lambda picks made prompt + the student's sample (on_policy.py)."""
        lmbda = self.section.value("lmbda")
        if lmbda == 0:
            return batch_samples
        return on_policy_step(self, batch_samples, lmbda, self.section.value("max_new_tokens"),
                              self.section.temperature)
