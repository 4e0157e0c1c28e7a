"""What a run's tracker runs leave in output_dir/trackers.json: per tracker, where its run lives and its id, so that a
resumed run reports into the same tracker run (mlflow_run.py, wandb_run.py). Never uploaded by `hftrain push` (the
Hub's allowlist, hub/stage.py), and written without credentials."""

from __future__ import annotations

import json
import os

import yaml

from ..constants import RECIPE_FILE
from ..fileio import atomic_write

RUNS_FILE = "trackers.json"


def recorded(output_dir: str, tracker: str) -> dict:
    """What this output_dir's run recorded of `tracker`'s run ({} when nothing)."""
    try:
        with open(os.path.join(output_dir, RUNS_FILE), encoding="utf-8") as f:
            entry = json.load(f).get(tracker, {})
    except (OSError, ValueError, AttributeError):
        return {}
    return entry if isinstance(entry, dict) else {}


def record(output_dir: str, tracker: str, entry: dict) -> None:
    """`tracker`'s run recorded beside the others'."""
    path = os.path.join(output_dir, RUNS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)
    except (OSError, ValueError):
        runs = {}
    atomic_write(path, json.dumps({**(runs if isinstance(runs, dict) else {}), tracker: entry}, indent=2))


def resolved_recipe(output_dir: str) -> tuple[str, dict]:
    """(the path, the mapping) of the run's resolved recipe, as write_recipe left it ({} when there is none)."""
    path = os.path.join(output_dir, RECIPE_FILE)
    if not os.path.exists(path):
        return path, {}
    with open(path, encoding="utf-8") as f:
        return path, yaml.safe_load(f) or {}
