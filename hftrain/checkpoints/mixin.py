"""Checkpoints the Trainer writes and resumes, made safe (this package: folders, manifest, verify, layout):

- `_save_checkpoint`: super() writes under a staging folder; once every rank has written its part, the layout and
  the manifest (size and sha256 of every file) are added and the folder is renamed into place, then rotated;
- `train`: resumes from a verified checkpoint (`True`: the newest complete one), converting a ZeRO checkpoint of
  another world size to DeepSpeed's universal format first;
- `_load_from_checkpoint`, `_load_best_model`: weights saved in a family's original format (transformers 5 saves
  fused MoE experts per expert) read through from_pretrained, which converts them, instead of the Trainer's
  unconverted, non-strict load;
- `_load_optimizer_and_scheduler`: skipped with training.resume_weights_only;
- `_load_rng_state`: an error naming the damaged file instead of torch's advice to unpickle it.
The Trainer's own save writes in place and has no staging folder: patches/transformers.py redirects it.
"""

from __future__ import annotations

import json
import os
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .. import distributed, fileio
from ..config import strategy_of_deepspeed_config
from ..errors import CheckpointError
from ..guards import check_finite_weights
from ..mesh import gathered_state_dict
from ..modeling import without_tied_copies
from ..moe.blocks import unwrap
from ..moe.expert_parallel import expert_parallel_size
from ..patches.deepspeed import untie_zero3_universal_steps
from ..patches.transformers import staged_checkpoint_dir
from ..quantization import quantization_of_model
from . import folders, manifest, verify, world_size


class StagedCheckpointMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # DeepSpeed restores the optimizer with the weights in one load_checkpoint call, and ZeRO's optimizer files
        # hold the weights' partitions: refused there (preflight; here too, for a direct caller).
        if self.args.resume_weights_only and self.is_deepspeed_enabled:
            raise CheckpointError("training.resume_weights_only cannot be used with a DeepSpeed (ZeRO) strategy: "
                                  "its optimizer state holds the weights' partitions; resume the whole checkpoint")

    def train(self, resume_from_checkpoint=None, **kwargs):
        """`resume_from_checkpoint`: a checkpoint folder, or True for the newest complete one in output_dir
        (incomplete ones are skipped with a warning); None after an elastic restart: the newest complete one."""
        restarted = distributed.restart_count() > 0
        weights_only = self.args.resume_weights_only
        path = verify.resolve_resume(resume_from_checkpoint, self.args.output_dir, restarted,
                                          warn=distributed.print0, weights_only=weights_only)
        if path and weights_only:
            distributed.print0(f"hftrain: resuming the weights only from {path} (training.resume_weights_only): the "
                               "optimizer state starts fresh and the learning-rate schedule restarts at its first step")
        if restarted and path and resume_from_checkpoint in (None, False):
            distributed.print0(f"hftrain: restarted by the launcher: resuming from {path}")
        now = self._layout()
        world_size.check_layout(path, now)
        if world_size.needs_universal(path, now):  # ZeRO on another world size: reshard through DeepSpeed's format
            distributed.barrier()  # every rank has verified the checkpoint before the main process adds to it
            with distributed.main_process_first():
                universal = world_size.to_universal(path)
            untie_zero3_universal_steps()
            self.accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}
            distributed.print0(f"hftrain: {path} was written by another number of ranks: resuming from its "
                               f"universal checkpoint {universal}")
        return super().train(resume_from_checkpoint=path, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self._load_converted(resume_from_checkpoint, self.model if model is None else model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        if not self._load_converted(self.state.best_model_checkpoint, self.model):
            super()._load_best_model()

    def _load_converted(self, path: str, model) -> bool:
        """The Trainer loads model.safetensors with load_state_dict(strict=False) as it is on disk (a resume, the best
        model at the end). transformers 5 saves some families in their original format (Mixtral's and Qwen-MoE's
        experts per expert, where the model holds them fused), so every expert would keep the weights it had, with no
        more than a warning. Such a checkpoint is read with from_pretrained, which converts, and loaded strictly.
        False: nothing to convert (or FSDP's, DeepSpeed's, an adapter's own format): the Trainer loads it."""
        saved = folders.saved_weight_names(path)
        own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or not saved or saved <= own:
            return False
        converted = type(model).from_pretrained(path, dtype=next(model.parameters()).dtype, device_map="cpu",
                                                use_safetensors=True)
        model.load_state_dict(converted.state_dict(), strict=True)
        del converted
        return True

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Skipped with training.resume_weights_only (the Trainer would load whatever of them is there)."""
        if not self.args.resume_weights_only:
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint):
        """The Trainer's load, with an error naming the file instead of torch's (which suggests weights_only=False);
        verify.verify has read the files already, this catches what changed since."""
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
        model = unwrap(self.model)
        return {**world_size.layout(a.world_size, a.per_device_train_batch_size, a.gradient_accumulation_steps,
                                    strategy, distributed.sequence_parallel_size(self.args),
                                    expert_parallel_size(model), distributed.mesh_degrees(self.accelerator)),
                "quantization": quantization_of_model(model)}  # the base trained against (launch/resume.py)

    def _save(self, output_dir=None, state_dict=None):
        """A gathered state dict (FSDP2's final save; a tensor-parallel model's, gathered here on every rank) written
        as a one-process save writes it: tied copies left out."""
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is None and (getattr(model, "tp_size", None) or 1) > 1:
            state_dict = gathered_state_dict(model)
        if state_dict is not None:
            state_dict = without_tied_copies(state_dict, model)
        super()._save(output_dir, state_dict=state_dict)

    def _save_checkpoint(self, model, trial) -> None:
        check_finite_weights(self.model, f"checkpoint-{self.state.global_step}")  # every rank its shards
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        root = folders.staging_root(run_dir)
        staged, final = os.path.join(root, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.lexists(staged):
            shutil.rmtree(staged)  # a leftover of an interrupted save of the same step
        distributed.barrier()
        try:
            with staged_checkpoint_dir(self, root):  # super() writes (and rotates) under the staging root
                super()._save_checkpoint(model, trial)
        except Exception as e:
            error = folders.save_failure(e, staged, run_dir)
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
                fileio.remove_staging_root(root)
            raise error from e
        distributed.barrier()  # every rank has written its part (sharded strategies: its shards)
        if self.args.should_save:
            self._publish(staged, final, run_dir, root)
        distributed.barrier()

    def _publish(self, staged: str, final: str, run_dir: str, root: str) -> None:
        """Main process: the best checkpoint's path as it will be, the layout and the manifest, then the rename."""
        if self.state.best_global_step:  # super() looked for the best checkpoint under the staging root
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if best == final or os.path.isdir(best):
                self.state.best_model_checkpoint = best
                self.state.save_to_json(os.path.join(staged, folders.STATE))
        try:
            with open(os.path.join(staged, world_size.LAYOUT), "w", encoding="utf-8") as fh:
                json.dump(self._layout(), fh)
            # Last, once every rank has written its part (the barrier before): sizes and sha256 of every file.
            manifest.write_manifest(staged)
            fileio.publish(staged, final)
        except OSError as e:
            error = folders.save_failure(e, staged, run_dir)
            shutil.rmtree(staged, ignore_errors=True)
            fileio.remove_staging_root(root)
            raise error from e
        rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
