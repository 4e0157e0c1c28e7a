"""KTO (Kahneman-Tversky optimisation, unpaired examples labelled desirable or not): TRL's KTOTrainer (its tokenising,
KL completions, loss and metrics) with hftrain's run mixins (staged checkpoints, guards, compression; trainer/), and
what TRL 1.16 lacks, written here: the loss and its KL reference point exact over the optimizer step's global batch.

TRL, for each micro-batch: the KL reference point z = max(0, mean over the micro-batch of log pi(y'|x) - log
pi_ref(y'|x)), with y' the completion of the example before (KL completions rotated within each fixed micro-batch),
averaged over the ranks' micro-batches of that accumulation step (one gather per micro-batch); the loss is the mean
over the micro-batch's examples of w * (1 - sigmoid(beta * (r - z))) for a desirable example and
w * (1 - sigmoid(beta * (z - r))) for an undesirable one (r = beta-free log-ratio to the reference, w the
desirable / undesirable weight); the Trainer then averages the micro-batches over the accumulation steps. So both z
and the loss change with the world size and the accumulation: z of a micro-step sees only that micro-step's
micro-batches, and an example of a smaller micro-batch weighs more.

hftrain trains on the exact quantities of the optimizer step's global batch, whatever the world size and accumulation:

    z    = max(0, sum over every example of the step (all micro-batches, all ranks) of the KL log-ratio / their number)
    loss = sum over every example of the step of its weighted KTO loss against that z / their number

z is computed before the step's first forward with gradients (`get_batch_samples`: TRL's own KL forwards of the policy
and the reference over each micro-batch, no gradient, then one all-reduce), and TRL's `_compute_loss` is handed it in
place of its per-micro-batch forwards, which are therefore not run twice: the policy's KL log-probs come back as z
and the reference's as 0, so TRL's `(KL_logps - ref_KL_logps).mean()`, gathered and clamped, is z. The loss TRL
returns (its mean over the micro-batch) times the micro-batch's examples, over the step's global count, is the
micro-batch's share (losses.normalise). The evaluation is TRL's, per eval batch.
"""

from __future__ import annotations

import dataclasses

import torch
from accelerate.utils import is_peft_model
from trl import KTOConfig, KTOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from ...losses import GlobalBatchMixin
from ...config import HFTrainOptions, Recipe
from .unpaired import build_unpaired_data
from ...trainer import RUN_MIXINS
from .. import registry
from ..policy import PreferenceMethod
from ..base import first_rows, has_template
from ..fused_head import FusedHeadMixin


@dataclasses.dataclass
class HFKTOConfig(KTOConfig, HFTrainOptions):
    """TRL's KTOConfig with hftrain's options."""


def kto_config(recipe: Recipe, **kwargs) -> HFKTOConfig:
    """The run's arguments (`kwargs`: every TrainingArguments value launch.setup resolved) plus the preference
    section's. KTOConfig's own default train_sampling_strategy, sequential, stays (rules.py refuses another)."""
    p = recipe.preference
    return HFKTOConfig(**kwargs, loss_type="kto", beta=p.beta, desirable_weight=p.desirable_weight,
                       undesirable_weight=p.undesirable_weight, precompute_ref_log_probs=p.precompute_ref_log_probs,
                       max_length=recipe.data.max_length, disable_dropout=True)


class GlobalKLMixin(GlobalBatchMixin):
    """KTO's KL reference point and loss exact over the optimizer step's global batch (the module docstring)."""

    step_kl: torch.Tensor | None = None  # the optimizer step's KL reference point z (training)
    _kl_calls: int | None = None  # KL forwards TRL asked for in the loss being computed (None: TRL's own forwards)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The examples of the optimizer step over every micro-batch and rank."""
        if not batch_samples or "label" not in batch_samples[0]:
            return None
        return self.global_sum(torch.tensor(sum(len(b["label"]) for b in batch_samples), device=device))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One optimizer step's micro-batches, and its KL reference point over all of them."""
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.step_kl = self._global_kl(batch_samples) if self.calculate_KL and batch_samples else None
        return batch_samples, num_items

    def _global_kl(self, batch_samples: list) -> torch.Tensor:
        """max(0, mean KL log-ratio over the step's examples on every rank): TRL's KL forwards, then one all-reduce."""
        model = self.model_wrapped
        model.train()  # as training_step will set it (dropout is off: the same log-probs either way)
        total = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        for batch in batch_samples:
            batch = self._prepare_inputs(batch)
            ratio = self._compute_kl_logps(model, batch) - self._reference_kl_logps(batch)
            total += torch.stack([ratio.double().sum(), torch.tensor(ratio.numel(), dtype=torch.float64,
                                                                      device=total.device)])
        total = self.global_sum(total)
        return (total[0] / total[1]).clamp(min=0).float()

    def _reference_kl_logps(self, batch: dict) -> torch.Tensor:
        """The reference's log-probs of the KL completions, from where TRL's `_compute_loss` takes them: precomputed,
        the policy with its LoRA adapter disabled, or the frozen copy (the same branches, TRL's own forward)."""
        if self.precompute_ref_logps:
            return batch["ref_KL_logps"]
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if is_peft_model(self.model) and self.ref_model is None:
                unwrapped = self.accelerator.unwrap_model(self.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    return self._compute_kl_logps(self.model, batch)
            return self._compute_kl_logps(self.ref_model, batch)

    def _compute_kl_logps(self, model, batch):
        """TRL's KL forward, except within a training loss: there the step's z for the policy's call (TRL's first)
        and 0 for the reference's (its second), so that TRL's KL is z (tests/test_upstream_contract.py holds the
        order)."""
        if self._kl_calls is None:
            return super()._compute_kl_logps(model, batch)
        n = batch["KL_input_ids"].shape[0]
        value = self.step_kl.to(batch["KL_input_ids"].device).expand(n).clone()
        self._kl_calls += 1
        return value if self._kl_calls == 1 else torch.zeros_like(value)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        exact = model.training and num_items_in_batch is not None
        if exact and self.step_kl is not None:
            self._kl_calls = 0
            if self.precompute_ref_logps:  # TRL reads the reference's KL log-probs from the batch: 0, as above
                inputs = {**inputs, "ref_KL_logps": torch.zeros_like(inputs["ref_KL_logps"])}
        try:
            out = super().compute_loss(model, inputs, return_outputs=return_outputs)
        finally:
            self._kl_calls = None
        if not exact:  # eval: the eval batch's loss and KL, as TRL computes them
            return out
        loss, outputs = out if return_outputs else (out, None)
        loss = self.step_share(loss * len(inputs["label"]), num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


class KTOPreferenceTrainer(*RUN_MIXINS, GlobalKLMixin, FusedHeadMixin, KTOTrainer):
    """TRL's KTOTrainer (its tokenising, KL completions, loss, metrics and eval) with hftrain's checkpoints, guards and
    compression, and the exact KL reference point and loss; `args` is an HFKTOConfig (kto_config)."""


def read_examples(recipe: Recipe, tokenizer, world_size: int, seed: int):
    """Examples labelled desirable or not (pairs split in two), checked, measured as TRL will truncate them, shuffled
    once (data.unpaired)."""
    return build_unpaired_data(recipe.data, has_template(tokenizer), seed=seed, tokenizer=tokenizer)


METHOD = PreferenceMethod(
    entry=registry.KTO,
    read=read_examples, show=lambda recipe, tokenizer, n: first_rows(
        METHOD, recipe, tokenizer, n, "examples, in training order (label true: desirable, false: undesirable)"),
    arguments=kto_config, trainer_class=KTOPreferenceTrainer)
