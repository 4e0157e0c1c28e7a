"""One 2-rank reference run per strategy for the whole test session (issue 36), shared by every module that compares
against one: test_strategies (engines, losses and eval across strategies), test_resume (killed and resumed runs
must end with the reference's weights; its checkpoints are resumed on other world sizes) and test_e2e (a DDP run's
outputs). They all use this recipe, so one run serves them all.

Under pytest-xdist the runs are shared by the workers too: made once, under a file lock, in a folder beside the
workers' own (pytest's base temporary folder is per worker), with the tiny model they train, so a run made by one
worker is read by the other as it is. `conftest.reference_runs` is the fixture."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from filelock import FileLock

STEPS, SAVE = 6, 2  # every reference trains 6 steps and publishes checkpoint-2, -4, -6 (the last 2 kept)
EXACT_MATCH = 8
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload")


def reference_recipe(folder, model_dir, out, train: str, evaluate: str, name="recipe.yaml", **training) -> str:
    """The reference runs' recipe (with output_dir `out`), written as folder/name; `training` overrides keys."""
    path = os.path.join(str(folder), name)
    with open(path, "w") as fh:
        yaml.safe_dump({
            "model": {"name_or_path": str(model_dir), "dtype": "float32"},
            "data": {"sources": [{"path": train}], "eval_sources": [{"path": evaluate}], "max_length": 64},
            "eval": {"exact_match": EXACT_MATCH, "max_new_tokens": 8},
            "training": {"output_dir": str(out), "max_steps": STEPS, "save_steps": SAVE, "save_total_limit": 2,
                         "per_device_train_batch_size": 2, "per_device_eval_batch_size": 64, "learning_rate": 3e-3,
                         "warmup_steps": 0, "logging_steps": 1, "report_to": "tensorboard", "disable_tqdm": True,
                         "seed": 0, **training},
        }, fh)
    return path


class ReferenceRuns:
    """reference_runs(strategy) -> the run's output folder (made on first use, by whichever worker asks first);
    .stdout(strategy) its launch's standard output; .model_dir the tiny model every reference trained."""

    def __init__(self, root: str, model_dir: str, launch):
        self.root, self.model_dir, self.launch = root, model_dir, launch

    def __call__(self, strategy: str):
        folder = os.path.join(self.root, strategy)
        out = os.path.join(folder, "out")
        with FileLock(os.path.join(self.root, f"{strategy}.lock")):
            done = os.path.join(folder, "done.json")
            if not os.path.exists(done):
                os.makedirs(folder, exist_ok=True)
                r = self.launch(strategy, folder, out)
                with open(os.path.join(folder, "stdout.txt"), "w") as fh:
                    fh.write(r.stdout)
                assert r.returncode == 0, (f"the {strategy} reference run failed:\n" + r.stdout[-3000:]
                                           + r.stderr[-4000:])
                with open(done, "w") as fh:
                    json.dump({"strategy": strategy}, fh)
        return Path(out)

    def stdout(self, strategy: str) -> str:
        self(strategy)
        with open(os.path.join(self.root, strategy, "stdout.txt")) as fh:
            return fh.read()
