"""hftrain's Trainer: transformers' Trainer with the loss normalisation of `losses.py`.

A subclass because `compute_loss_func` receives neither position_ids (packed sequence averaging needs them) nor a
way to count sequences, and the Trainer multiplies its result by the world size only in some branches. Overrides:
- `_get_num_items_in_batch`: the step's target tokens and sequences over all micro-batches and ranks (one gather);
- `compute_loss`: no labels passed (so no model-internal loss); the CE from the logits, or (training.loss_impl
  chunked/auto) from lm_head's input in chunks without the logits (chunked_ce.py); then
  `losses.loss_sum / global count * dp_size` plus registered aux terms;
- `evaluation_loop` / `prediction_step`: eval_loss = mean CE over every target token of the eval set, each example
  once (per-example sums through `gather_for_metrics`, which drops the rows the sampler repeated to fill its last
  batch), whatever the number of processes, the eval batch size or the strategy;
- `log`: the global target-token count per step, and the metrics of callbacks with a `pop_logs()`;
- `_save_checkpoint` / `train`: staged checkpoints, resumed from the newest complete one (checkpoints.py);
  the manifest written last (manifest.py) and verified at resume; `_load_optimizer_and_scheduler` skipped with
  training.resume_weights_only; `_load_rng_state` naming a damaged file;
- gradient compression (compression.py): DDP gets hftrain's comm hook, FSDP2 its reduce dtype;
- `_prepare_for_training` / `compute_loss` / `_get_grad_norm`: guards.py's checks, the engine built against the
  recipe's strategy once wrapped, and finite-or-stop (or skip) once per optimizer step, before the update.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from . import checkpoints, chunked_ce, distributed, guards, losses, manifest
from . import compression as comp
from .config import strategy_of_deepspeed_config
from .data.collate import PackedRows, make_collator
from .errors import CheckpointError, ModelError
from .patches.deepspeed import untie_zero3_universal_steps
from .patches.transformers import staged_checkpoint_dir


class HFTrainer(Trainer):
    def __init__(self, *args, loss_averaging: str = "token", compression=None, resume_weights_only: bool = False,
                 strategy: str | None = None, max_bad_steps: int = 0, loss_impl: str = "logits", **kwargs):
        if loss_averaging not in losses.MODES:
            raise ValueError(f"training.loss_averaging must be one of {losses.MODES}, got {loss_averaging!r}")
        # A subclass whose other parent builds this one without these keywords (TRL's DPOTrainer, preference.py)
        # sets them on the instance first: `hftrain_options`.
        preset = getattr(self, "hftrain_options", {})
        compression = preset.get("compression", compression)
        resume_weights_only = preset.get("resume_weights_only", resume_weights_only)
        max_bad_steps = preset.get("max_bad_steps", max_bad_steps)
        strategy = preset.get("strategy", strategy)
        # A method, or method none with profile (the plain all-reduce timed in hftrain's hook; DDP only, rules.py).
        self.compression = (compression if compression is not None and (compression.method != "none"
                                                                         or compression.profile) else None)
        if self.compression is not None:
            self.comm_metrics = comp.CommMetricsCallback(self.compression)
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.comm_metrics]
        super().__init__(*args, **kwargs)
        self.loss_averaging = loss_averaging
        # training.resume_weights_only: resume the weights (and step, data position, RNG) with a fresh optimizer and
        # schedule. DeepSpeed restores both in one load_checkpoint call, and ZeRO's optimizer files hold the weights'
        # partitions: refused there (preflight; here too, for a direct caller).
        if resume_weights_only and self.is_deepspeed_enabled:
            raise CheckpointError("training.resume_weights_only cannot be used with a DeepSpeed (ZeRO) strategy: "
                                  "its optimizer state holds the weights' partitions; resume the whole checkpoint")
        self.resume_weights_only = resume_weights_only
        self.loss_is_scaled_for_ga = True  # our loss is already normalised over the whole accumulated batch
        # name -> (fn(outputs) -> scalar tensor, coefficient); see losses.aux_loss_term
        self.aux_losses: dict[str, tuple[Callable, float]] = {}
        self._step_counts: list[tuple[int, int]] = []
        self._last_counts: tuple[int, int] | None = None
        self._aux_logged: dict[str, list[float]] = {}
        self._eval_sums: list[torch.Tensor] = []  # per-example (CE sum, targets) of the evaluation in progress
        self.strategy = strategy  # the recipe's strategy name: the engine built is checked against it (None: not)
        self.step_guard = guards.StepGuard(max_bad_steps)
        self.loss_chunk_size: int | None = None  # target tokens per chunk of the chunked loss (None: by vocabulary)
        self._head = self._chunked_head(loss_impl)  # (lm_head, HeadMath) when the loss is chunked, else None

    # -- gradient compression ----------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.compression is not None and self.accelerator.ddp_handler is not None:
            self.accelerator.ddp_handler = comp.ddp_kwargs_with_hook(
                self.accelerator.ddp_handler, self.compression, self.comm_metrics.on_hook_registered)
        reduce_dtype = comp.fsdp_reduce_dtype(self.compression) if self.compression is not None else None
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is not None and reduce_dtype is not None:
            old = plugin.mixed_precision_policy
            plugin.mixed_precision_policy = MixedPrecisionPolicy(
                param_dtype=getattr(old, "param_dtype", None), reduce_dtype=reduce_dtype,
                output_dtype=getattr(old, "output_dtype", None))

    # -- counting --------------------------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        local = torch.zeros(2, dtype=torch.long, device=device)
        for b in batch_samples:
            tokens, seqs = losses.count_targets(b["labels"], b.get("position_ids"))
            local += torch.tensor([tokens, seqs], device=device)
        total = self.accelerator.gather(local.unsqueeze(0)).sum(0) if self.args.world_size > 1 else local
        self._last_counts = (int(total[0]), int(total[1]))
        count = total[0] if self.loss_averaging == "token" else total[1]
        return count.clamp(min=1)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One optimizer step's micro-batches (training only): remember the step's global counts for logging."""
        self._last_counts = None
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._last_counts is not None:
            self._step_counts.append(self._last_counts)
        return batch_samples, num_items

    # -- loss ------------------------------------------------------------------------------------------------
    def _chunked_head(self, loss_impl: str):
        """training.loss_impl -> (lm_head, its maths) for the chunked loss, or None for the logits path."""
        if loss_impl == "logits":
            return None
        # Every strategy: FSDP2 and ZeRO-3 shard lm_head's weight, _ce has it gathered for the loss.
        head, math, why = chunked_ce.head_of(self.model)
        if not why:
            return head, math
        if loss_impl == "chunked":
            raise ModelError(f"training.loss_impl: chunked cannot be used: {why}; set training.loss_impl: auto "
                             "(the logits path where chunked is not supported) or logits")
        distributed.print0(f"hftrain: training.loss_impl auto: the loss is computed from logits ({why})")
        return None

    def _forward(self, model, inputs: dict, capture: bool = False):
        """The model's outputs without labels (no model-internal loss); refuses a model that returns no logits.
        `capture`: lm_head computes no logits and its input is returned too (chunked_ce.capture_hidden)."""
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        if capture:
            with chunked_ce.capture_hidden(self._head[0]) as captured:
                return model(**inputs), captured
        outputs = model(**inputs)
        if getattr(outputs, "logits", None) is None:
            raise ValueError(
                f"{type(self.accelerator.unwrap_model(model)).__name__} returned no logits; hftrain computes the loss "
                "from logits (or, training.loss_impl: chunked, from lm_head's input) so that it is exact over the "
                "global batch"
            )
        return outputs

    def _ce(self, model, inputs: dict, labels: torch.Tensor, mode: str | None = None, label_smoothing: float = 0.0):
        """(outputs, the flattened per-position CE), or with `mode` (outputs, losses.loss_sum): chunked from
        lm_head's input when the loss is chunked, else from the logits."""
        pos = inputs.get("position_ids")
        if self._head is None:
            outputs = self._forward(model, inputs)
            ce = losses.target_ce(outputs.logits, labels[:, 1:], label_smoothing)
            return outputs, ce if mode is None else losses.sum_ce(ce, labels, mode, pos)
        outputs, c = self._forward(model, inputs, capture=True)
        # FSDP2: c.weight is the unsharded parameter lm_head ran with (a plain tensor). accelerate's FSDP2 puts lm_head
        # in a unit with reshard_after_forward=False (the root's default too), so it is still gathered here, and the
        # gradient the chunked loss accumulates into it is reduce-scattered by that unit's post-backward like
        # lm_head's own. ZeRO-3 releases it after lm_head's forward: gathered again for the loss (Captured.gathered),
        # its gradient reduce-scattered by DeepSpeed's hook on the parameter. Freed storage here: refuse to read it.
        hidden = c.hidden.reshape(*labels.shape, c.hidden.shape[-1])  # packed rows joined for flash: back in rows
        with c.gathered(self.is_deepspeed_enabled), c.autocast():  # the head's matmul in the model's forward dtype
            if c.weight.untyped_storage().size() == 0:
                raise RuntimeError("lm_head's weight is not gathered after the model's forward (resharded); the "
                                   "chunked loss needs it: set training.loss_impl: logits")
            if mode is None:
                return outputs, losses.hidden_ce(hidden, c.weight, c.bias, labels, self._head[1], label_smoothing,
                                                 self.loss_chunk_size)
            loss = losses.hidden_loss_sum(hidden, c.weight, c.bias, labels, mode, pos, self._head[1],
                                          label_smoothing, self.loss_chunk_size)
        if self.is_deepspeed_enabled and loss.requires_grad:  # ZeRO-3 pairs lm_head's backward hooks: see _Placeholder
            loss = loss + outputs.logits.sum() * 0
        return outputs, loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs, loss_sum = self._ce(model, inputs, labels, self.loss_averaging, self.args.label_smoothing_factor)
        if num_items_in_batch is None:  # a path that did not count (e.g. a direct call): this batch alone
            tokens, seqs = losses.count_targets(labels, inputs.get("position_ids"))
            num_items_in_batch = max(tokens if self.loss_averaging == "token" else seqs, 1)
        dp_size = self.accelerator.num_processes // self.get_tp_size()
        total = losses.normalise(
            loss_sum,
            num_items_in_batch,
            dp_size,
        )
        if model.training:
            for name, (fn, coef) in self.aux_losses.items():
                aux = fn(outputs)
                total = total + losses.aux_loss_term(aux, coef, self.current_gradient_accumulation_steps)
                self._aux_logged.setdefault(name, []).append(float(aux.detach()))
            self._guard_loss(total)  # finite or stop (guards.py)
        return (total, outputs) if return_outputs else total

    # -- evaluation ------------------------------------------------------------------------------------------
    def get_eval_dataloader(self, eval_dataset=None):
        """Eval batches are padded, never packed: `prediction_step` needs one row per example in the sampler's order
        (packing reorders examples and adds padding sequences), so that the sampler's repeats are dropped by
        position and every rank gathers as many rows. Per-example losses are the same either way (tested)."""
        if not isinstance(self.data_collator, PackedRows):
            return super().get_eval_dataloader(eval_dataset)
        packed, self.data_collator = self.data_collator, make_collator(self.processing_class, packing=False)
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

    # -- logging ---------------------------------------------------------------------------------------------
    def log(self, logs: dict, start_time=None) -> None:
        if "loss" in logs:  # a training log (every rank logs it)
            if self._step_counts:  # token counts (a preference loss counts pairs instead: none recorded)
                tokens = [c[0] for c in self._step_counts]
                logs["target_tokens_per_step"] = sum(tokens) / len(tokens)
                if self.loss_averaging == "sequence":
                    logs["sequences_per_step"] = sum(c[1] for c in self._step_counts) / len(self._step_counts)
                self._step_counts.clear()
            for name, values in self._aux_logged.items():
                logs[name] = sum(values) / len(values)
            self._aux_logged.clear()
            if self.step_guard.max_bad_steps > 0:
                logs["bad_steps"] = self.step_guard.bad_steps  # skipped so far (cumulative)
            for cb in self.callback_handler.callbacks:  # comm/* (compression), moe/* (router health), ...
                if hasattr(cb, "pop_logs"):  # called on every rank: it may run a collective
                    logs.update(cb.pop_logs())
        super().log(logs, start_time)

    # -- guards (guards.py) ----------------------------------------------------------------------------------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """super() wraps the model (DDP / FSDP2 / DeepSpeed); before the first step, that engine must be the one
        the recipe asked for (an environment can make accelerate silently build another)."""
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.strategy is not None:
            guards.raise_engine_problem(self.strategy, self)
        return model, train_dataloader

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
        (transformers 5.23 `_inner_training_loop`): the step's losses and gradient norm of every rank are judged
        here. A skipped step drops the gradients (set to None: torch's optimizers then leave those parameters and
        their state untouched, weight decay included); the LR scheduler and global_step still advance, as for a
        step the optimizer took. Under fp16 the grad scaler already skips steps with non-finite gradients (and
        lowers its scale), so only the loss is judged. Under DeepSpeed the engine stepped inside backward: a bad
        step stops the run (training.max_bad_steps is refused there)."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        step = self.state.global_step + 1
        bad = self.step_guard.verdict(grad_norm, self.args.device,
                                      check_grad_norm=self.accelerator.scaler is None)
        if self.step_guard.decide(bad, step, self.args, can_skip=not self.is_deepspeed_enabled,
                                  applied=self.is_deepspeed_enabled):
            model.zero_grad(set_to_none=True)
            if not torch.isfinite(self._tr_loss):  # with logging_nan_inf_filter off the logged loss stays finite
                self._tr_loss.zero_()
        return grad_norm

    def _refuse_nonfinite_weights(self) -> None:
        """A checkpoint of non-finite weights is never written (every rank checks its shards)."""
        guards.check_finite_weights(self.model, f"checkpoint-{self.state.global_step}")

    # -- checkpoints -----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, **kwargs):
        """`resume_from_checkpoint=True` means the newest complete checkpoint (incomplete ones are skipped with a
        warning); after an elastic restart (torchrun --max-restarts) the newest complete one, if any."""
        restarted = distributed.restart_count() > 0
        path = checkpoints.resolve_resume(resume_from_checkpoint, self.args.output_dir, restarted,
                                          warn=distributed.print0, weights_only=self.resume_weights_only)
        if path and self.resume_weights_only:
            distributed.print0(f"hftrain: resuming the weights only from {path} (training.resume_weights_only): the "
                               "optimizer state starts fresh and the learning-rate schedule restarts at its first step")
        if restarted and path and resume_from_checkpoint in (None, False):
            distributed.print0(f"hftrain: restarted by the launcher: resuming from {path}")
        now = self._layout()
        checkpoints.check_layout(path, now)
        if checkpoints.needs_universal(path, now):  # ZeRO on another world size: reshard through DeepSpeed's format
            distributed.barrier()  # every rank has verified the checkpoint before the main process adds to it
            with distributed.main_process_first():
                universal = checkpoints.to_universal(path)
            untie_zero3_universal_steps()
            self.accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}
            distributed.print0(f"hftrain: {path} was written by another number of ranks: resuming from its "
                               f"universal checkpoint {universal}")
        return super().train(resume_from_checkpoint=path, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Skipped with training.resume_weights_only (the Trainer would load whatever of them is there)."""
        if not self.resume_weights_only:
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint):
        """The Trainer's load, with an error naming the file instead of torch's (which suggests weights_only=False);
        checkpoints.verify has read the files already, this catches what changed since."""
        try:
            super()._load_rng_state(checkpoint)
        except Exception as e:
            name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
            raise CheckpointError(f"cannot resume from {checkpoint}: {name} cannot be loaded safely "
                                  f"({type(e).__name__}); resume from another checkpoint") from None

    def _layout(self) -> dict:
        if self.is_deepspeed_enabled:
            strategy = strategy_of_deepspeed_config(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        else:
            strategy = "fsdp" if self.is_fsdp_enabled else "ddp"
        a = self.args
        return checkpoints.layout(a.world_size, a.per_device_train_batch_size, a.gradient_accumulation_steps, strategy)

    def _save_checkpoint(self, model, trial) -> None:
        self._refuse_nonfinite_weights()
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        root = checkpoints.staging_root(run_dir)
        staged, final = os.path.join(root, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.lexists(staged):
            shutil.rmtree(staged)  # a leftover of an interrupted save of the same step
        distributed.barrier()
        try:
            with staged_checkpoint_dir(self, root):  # super() writes (and rotates) under the staging root
                super()._save_checkpoint(model, trial)
        except Exception as e:
            error = checkpoints.save_failure(e, staged, run_dir)
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
                checkpoints.remove_staging_root(root)
            raise error from e
        distributed.barrier()  # every rank has written its part (sharded strategies: its shards)
        if self.args.should_save:
            if self.state.best_global_step:  # super() looked for the best checkpoint under the staging root
                best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
                if best == final or os.path.isdir(best):
                    self.state.best_model_checkpoint = best
                    self.state.save_to_json(os.path.join(staged, checkpoints.STATE))
            try:
                with open(os.path.join(staged, checkpoints.LAYOUT), "w", encoding="utf-8") as fh:
                    json.dump(self._layout(), fh)
                # Last, once every rank has written its part (the barrier above): sizes and sha256 of every file.
                manifest.write_manifest(staged)
                checkpoints.publish(staged, final)
            except OSError as e:
                error = checkpoints.save_failure(e, staged, run_dir)
                shutil.rmtree(staged, ignore_errors=True)
                checkpoints.remove_staging_root(root)
                raise error from e
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        distributed.barrier()
