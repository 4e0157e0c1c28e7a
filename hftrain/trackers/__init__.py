"""The trackers a run reports to (`training.report_to`, transformers' own integrations): checked before the run
(report_to_checks.py: names transformers knows, never "all", each installed, its server or login there), and the
tracker run hftrain owns so that the whole run lands in one tracker run (mlflow_run.py, wandb_run.py, mixin.py; opened
on the world's process zero before the first step, the resolved recipe as its params or config, the same run again on
resume, recorded in trackers.json by records.py, hftrain's before/after figures logged before it ends)."""

from .report_to_checks import report_to_problems
from .mixin import TrackersMixin
from .names import requested

__all__ = ["report_to_problems", "TrackersMixin", "requested"]
