"""The MLflow run hftrain owns. transformers' MLflowCallback opens a run at the first step and ends it at the end of
train(), so the held-out evaluation after training and hftrain's before/after figures would start a second run of
their own (mlflow's fluent API opens one for any metric logged outside a run), and a resumed run starts a new one.
Opened here first, the callback logs into it and leaves it open (it ends only runs it started); hftrain records its id
in output_dir/trackers.json (records.py), opens the same run again on resume, and ends it after its own figures."""

from __future__ import annotations

import contextlib
import json
import os

from .names import without_credentials
from .records import record, recorded, resolved_recipe

TRACKER = "mlflow"
PARAM_PREFIX = "recipe."
MAX_PARAMS_SETTING = "MLFLOW_MAX_LOG_PARAMS"  # transformers' MLflowCallback: how many params it logs


def flat(mapping: dict, prefix: str = "") -> dict[str, str]:
    """A nested mapping as dotted keys with string values (MLflow's params)."""
    out: dict[str, str] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


def recorded_run(output_dir: str, tracking_uri: str) -> str | None:
    """The MLflow run id this output_dir's run recorded against this tracking URI, if any."""
    entry = recorded(output_dir, TRACKER)
    return entry.get("run_id") if entry.get("tracking_uri") == tracking_uri else None


class MlflowRun:
    """One MLflow run for the whole of an hftrain run, on the world's process zero."""

    def __init__(self, output_dir: str, run_name: str | None, resumed_from: str | None):
        import mlflow  # optional: imported only for a run that reports to MLflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri and not mlflow.is_tracking_uri_set():
            mlflow.set_tracking_uri(uri)
        uri = without_credentials(mlflow.get_tracking_uri())  # what trackers.json records and is matched against
        earlier = recorded_run(output_dir, uri) if resumed_from else None
        if earlier is None and os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
        self.run = mlflow.start_run(run_id=earlier, run_name=None if earlier else run_name)
        self.resumed = earlier is not None
        record(output_dir, TRACKER, {"tracking_uri": uri, "run_id": self.run.info.run_id})
        path, recipe = resolved_recipe(output_dir)
        if not recipe:
            return
        if self.resumed:  # params are fixed once logged: the run keeps its first start's, the new recipe is an artifact
            self.mlflow.log_artifact(path, f"resumed-from-{resumed_from}")
        else:
            self.log_recipe(path, recipe)

    def log_recipe(self, path: str, recipe: dict) -> None:
        """The resolved recipe as params (recipe.<key>; a value longer than MLflow takes is left to the artifact) and
        as the artifact recipe.yaml."""
        params = flat(recipe, PARAM_PREFIX)
        longest = self.mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
        batch = self.mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
        items = [(k, v) for k, v in params.items() if len(v) <= longest]
        for start in range(0, len(items), batch):
            self.mlflow.log_params(dict(items[start:start + batch]))
        self.mlflow.log_artifact(path)

    @contextlib.contextmanager
    def during_training(self):
        """While training: transformers' MLflowCallback, which logs the TrainingArguments as params at its set-up,
        logs none into a resumed run (MLFLOW_MAX_LOG_PARAMS=0, its own setting), whose params MLflow refuses to
        change (a resume's new max_steps and resume_from_checkpoint would be refused, with an error in the log)."""
        if not self.resumed:
            yield
            return
        before = os.environ.get(MAX_PARAMS_SETTING)
        os.environ[MAX_PARAMS_SETTING] = "0"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(MAX_PARAMS_SETTING, None)
            else:
                os.environ[MAX_PARAMS_SETTING] = before

    def finish(self, figures: dict, step: int) -> None:
        """hftrain's figures (numbers only) at the run's last step, then the run ended."""
        numbers = {k: float(v) for k, v in figures.items() if type(v) in (int, float)}
        if numbers:
            self.mlflow.log_metrics(numbers, step=step)
        self.mlflow.end_run()
