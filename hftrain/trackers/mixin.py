"""TrackersMixin (in RUN_MIXINS): the tracker runs hftrain owns (runs.py), opened on the world's process zero when
training starts (after the checkpoint to resume is known) and ended by report_figures, the run's last report."""

from __future__ import annotations

import contextlib
import os

from .names import requested
from .runs import MlflowRun


FIGURE_PREFIXES = ("initial_", "final_")  # run_info.json's held-out figures before and after training


def checkpoint_name(resume_from_checkpoint) -> str | None:
    """The checkpoint a run resumes from, by its folder's name (None: a fresh start)."""
    if not resume_from_checkpoint:
        return None
    if isinstance(resume_from_checkpoint, str):
        return os.path.basename(os.path.normpath(resume_from_checkpoint))
    return "checkpoint"


class TrackersMixin:
    _mlflow_run: MlflowRun | None = None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if "mlflow" in requested(self.args.report_to) and self.is_world_process_zero() and self._mlflow_run is None:
            resumed_from = checkpoint_name(resume_from_checkpoint)
            self._mlflow_run = MlflowRun(self.args.output_dir, self.args.run_name, resumed_from)
        with self._mlflow_run.callback_params_kept() if self._mlflow_run else contextlib.nullcontext():
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def report_figures(self, figures: dict) -> None:
        """hftrain's figures (initial_* / final_*: the held-out metrics before and after) to the tracker runs hftrain
        owns, which then end. Every rank calls it; the world's process zero reports."""
        if self._mlflow_run is not None:
            before_and_after = {k: v for k, v in figures.items() if k.startswith(FIGURE_PREFIXES)}
            self._mlflow_run.finish(before_and_after, self.state.global_step)
            self._mlflow_run = None
