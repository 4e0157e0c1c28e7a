"""Trainer callbacks: observation only (they never change the loss)."""

from __future__ import annotations

import os

from transformers import TrainerCallback

from .artifacts import CURVES_FILE, plot_curves


class CurvesCallback(TrainerCallback):
    """Saves `curves.png` (loss, learning rate, tokens/s) in output_dir at the end of training."""

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_curves(state.log_history, os.path.join(args.output_dir, CURVES_FILE))
