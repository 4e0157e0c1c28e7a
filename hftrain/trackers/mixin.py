"""TrackersMixin (in RUN_MIXINS): the tracker runs hftrain owns (mlflow_run.py, wandb_run.py), opened on the world's
process zero when training starts (after the checkpoint to resume is known) and ended by report_figures, the run's
last report."""

from __future__ import annotations

import contextlib
import os

from .mlflow_run import MlflowRun
from .names import requested
from .wandb_run import WandbRun

FIGURE_PREFIXES = ("initial_", "final_")  # run_info.json's held-out figures before and after training
OWNED = {"mlflow": MlflowRun, "wandb": WandbRun}  # the trackers whose run hftrain opens itself


def checkpoint_name(resume_from_checkpoint) -> str | None:
    """The checkpoint a run resumes from, by its folder's name (None: a fresh start)."""
    if not resume_from_checkpoint:
        return None
    if isinstance(resume_from_checkpoint, str):
        return os.path.basename(os.path.normpath(resume_from_checkpoint))
    return "checkpoint"


class TrackersMixin:
    _tracker_runs: list | None = None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self._tracker_runs is None:
            self._tracker_runs = self._open_tracker_runs(checkpoint_name(resume_from_checkpoint))
        with contextlib.ExitStack() as stack:
            for tracker_run in self._tracker_runs:
                stack.enter_context(tracker_run.during_training())
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def _open_tracker_runs(self, resumed_from: str | None) -> list:
        if not self.is_world_process_zero():
            return []
        return [OWNED[name](self.args.output_dir, self.args.run_name, resumed_from)
                for name in requested(self.args.report_to) if name in OWNED]

    def report_figures(self, figures: dict) -> None:
        """hftrain's figures (initial_* / final_*: the held-out metrics before and after) to the tracker runs hftrain
        owns, which then end. Every rank calls it; the world's process zero reports."""
        before_and_after = {k: v for k, v in figures.items() if k.startswith(FIGURE_PREFIXES)}
        for tracker_run in self._tracker_runs or []:
            tracker_run.finish(before_and_after, self.state.global_step)
        self._tracker_runs = []
