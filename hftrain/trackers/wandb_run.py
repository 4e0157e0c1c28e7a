"""The W&B run hftrain owns. transformers' WandbCallback starts a run (wandb.init) only where none is active; opened
here first, with an id hftrain records in output_dir/trackers.json (records.py), a resumed run reports into the same
W&B run (wandb's resume="allow": online it continues the run, offline `wandb sync` joins the pieces by their id),
the resolved recipe is the run's config under `recipe`, and hftrain's before/after figures go into its summary before
it finishes. The callback logs every step into it, as it always does."""

from __future__ import annotations

import contextlib
import os

from .records import record, recorded, resolved_recipe

TRACKER = "wandb"
DEFAULT_PROJECT = "huggingface"  # transformers' WandbCallback's, when WANDB_PROJECT is not set


class WandbRun:
    """One W&B run for the whole of an hftrain run, on the world's process zero."""

    def __init__(self, output_dir: str, run_name: str | None, resumed_from: str | None):
        import wandb  # optional: imported only for a run that reports to W&B

        project = os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT)
        entry = recorded(output_dir, TRACKER) if resumed_from else {}
        earlier = entry.get("run_id") if entry.get("project") == project else None
        _, recipe = resolved_recipe(output_dir)
        self.run = wandb.init(project=project, id=earlier, resume="allow", name=None if earlier else run_name,
                              config=None if earlier else {"recipe": recipe})  # id None: WANDB_RUN_ID's, or a new one
        if earlier:  # the first start's recipe stays the config; the resumed one beside it
            self.run.config.update({f"resumed_from_{resumed_from}": {"recipe": recipe}}, allow_val_change=True)
        self.resumed = earlier is not None
        record(output_dir, TRACKER, {"project": project, "run_id": self.run.id})

    def during_training(self):
        return contextlib.nullcontext()

    def finish(self, figures: dict, step: int) -> None:
        """hftrain's figures into the run's summary, then the run finished."""
        self.run.summary.update({k: float(v) for k, v in figures.items() if type(v) in (int, float)})
        self.run.finish()
