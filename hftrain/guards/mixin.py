"""Guards (this package) wired into the Trainer: the engine built is the one the recipe asked for, and every
optimizer step's losses and gradient norm are finite, else the step is skipped (training.max_bad_steps) or the run
stops naming the step."""

from __future__ import annotations

import torch

from . import engine, steps


class StepGuardMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_guard = steps.StepGuard(self.args.max_bad_steps)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """super() wraps the model (DDP / FSDP2 / DeepSpeed); before the first step, that engine must be the one
        the recipe asked for (args.strategy_name; an environment can make accelerate silently build another)."""
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.args.strategy_name is not None:
            engine.raise_engine_problem(self.args.strategy_name, self)
        return model, train_dataloader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            self._guard_loss(out[0] if return_outputs else out)
        return out

    def _guard_loss(self, loss: torch.Tensor) -> None:
        """Each training micro-batch's loss, kept on the device (no sync per micro-batch). DeepSpeed's engine steps
        inside backward, so there the step's losses are judged before the backward of its last micro-batch."""
        self.step_guard.add_loss(loss)
        if self.is_deepspeed_enabled and self.accelerator.sync_gradients:
            step = self.state.global_step + 1
            bad = self.step_guard.verdict(None, self.args.device, check_grad_norm=False)
            self.step_guard.decide(bad, step, self.args, can_skip=False)

    def _get_grad_norm(self, model, grad_norm=None):
        """Called once per optimizer step on every rank, after backward and clipping, before optimizer.step()
        (transformers 5.24 `_inner_training_loop`; the public `on_pre_optimizer_step` callback that follows it is not
        given the norm, and computing it again would cost a pass over the gradients and, sharded, a collective): the
        step's losses and gradient norm of every rank are judged here. A skipped step drops the gradients (set to
        None: torch's optimizers then leave those parameters and their state untouched, weight decay included); the
        LR scheduler and global_step still advance, as for a step the optimizer took. Under fp16 the grad scaler
        already skips steps with non-finite gradients (and lowers its scale), so only the loss is judged. Under
        DeepSpeed the engine stepped inside backward: a bad step stops the run (training.max_bad_steps is refused
        there)."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        step = self.state.global_step + 1
        bad = self.step_guard.verdict(grad_norm, self.args.device, check_grad_norm=self.accelerator.scaler is None)
        if self.step_guard.decide(bad, step, self.args, can_skip=not self.is_deepspeed_enabled,
                                  applied=self.is_deepspeed_enabled):
            model.zero_grad(set_to_none=True)
            if not torch.isfinite(self._tr_loss):  # with logging_nan_inf_filter off the logged loss stays finite
                self._tr_loss.zero_()
        return grad_norm

    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs and self.step_guard.max_bad_steps > 0:
            logs["bad_steps"] = self.step_guard.bad_steps  # skipped so far (cumulative)
        super().log(logs, start_time)
