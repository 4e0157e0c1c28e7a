"""A request to save and stop (stop_request/signals.py: SIGUSR1, as SLURM sends it before a job's time limit), acted
on between optimizer steps with a complete checkpoint.

The signal reaches the ranks at different moments (each node's slurmd signals its own processes; a hand-sent signal
reaches one process), so after every optimizer step the ranks combine what they have seen (distributed.any_rank: one
MAX all-reduce of one number, beside the step guard's own per-step all-gather) and all stop after the same step. That
step is saved through the Trainer's own save (staged, verified and published by StagedCheckpointMixin, whatever
save_strategy says), train() returns, and `stopped_at` tells the run (lifecycle.run) to end there without the final
save: exit status 0, output_dir holding checkpoint-N and no run_info.json, and the file HFTRAIN_STOP_MARKER names
(the SLURM script's sign to requeue the job) holding the checkpoint's path. A restarted run (a requeued SLURM job,
SLURM_RESTART_COUNT) resumes from that checkpoint, to the numbers of a run never stopped. Why by hand: the Trainer
has no such request; its callbacks are the public way to ask for a save and a stop at a step.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from .. import distributed
from ..constants import STOP_MARKER_ENV
from ..fileio import atomic_write
from . import signals


class _StopAtAgreedStep(TrainerCallback):
    """After each optimizer step: does any rank have a request? Then save this step and stop, on every rank."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.stopped_at is not None or state.global_step >= state.max_steps:
            return control  # the last step: the run finishes, and saves, anyway (every rank knows it: no collective)
        if distributed.any_rank(signals.requested(), args.device):
            control.should_save = True
            control.should_training_stop = True
            self.trainer.stopped_at = state.global_step
        return control


class StopRequestMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stopped_at: int | None = None  # the step every rank stopped after, on a request
        signals.arm()  # a run's set-up has armed it already (before the model loaded); a direct caller had not
        self.add_callback(_StopAtAgreedStep(self))

    def train(self, *args, **kwargs):
        self.stopped_at = None
        output = super().train(*args, **kwargs)
        if self.stopped_at is not None:
            marker = os.environ.get(STOP_MARKER_ENV)
            if marker and self.is_world_process_zero():  # the SLURM script requeues the job when it finds it
                atomic_write(marker, f"{os.path.join(self.args.output_dir, f'checkpoint-{self.stopped_at}')}\n")
            distributed.print0(
                f"hftrain: stop requested (SIGUSR1: SLURM's warning before the time limit, or kill -USR1): every rank "
                f"stopped after step {self.stopped_at} of {self.state.max_steps}, saved as checkpoint-"
                f"{self.stopped_at} in {self.args.output_dir}. Continue with training.resume_from_checkpoint: true (a "
                "requeued SLURM job resumes from it by itself)")
        return output
