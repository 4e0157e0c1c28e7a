"""`hftrain score MODEL ROWS` for a process reward model, after a run: stepwise rows outside its run (prompt,
completions: the steps, labels: one true/false per step, as `hftrain reward` with kind process reads them) scored
step by step, RewardBench's way per subset (a column of the rows): the steps, the step accuracy (a step judged
correct when the model gives label 1 the higher probability, as the run's eval_step_accuracy counts it) and the F1 of
the correct-step class (the run's eval_step_f1).

Each row is tokenised as the training data phase tokenises it (step_rows.tokenised_steps: the prompt, then each step
alone followed by the separator's token) and scored by methods/process_reward_model.py, the scorer GRPO's
`grpo.rewards: [{model: PRM, aggregate: ...}]` uses: the probability of label 1 at each separator token. The separator
is the one the model was trained at (the recipe.yaml its run wrote beside the weights), or `--separator`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ...config import DataSource, ModelSection
from ...data import read_rows
from ...errors import DataError, RewardError
from ...modeling import load_tokenizer
from ..process_reward_model import ProcessRewardModel
from ..reward_model import ProcessOptions, model_folder, reward_model_problems, trained_separator
from .figures import step_figures
from .step_rows import steps_of_row, tokenised_steps
from .subsets import KEY, device_of, existing, per_subset, subset_of


@dataclass(frozen=True)
class StepScore:
    rows: int
    steps: int
    step_accuracy: float
    step_f1: float


def checked_prm(name: str, separator: str | None, trust_remote_code: bool) -> ProcessRewardModel:
    """The process reward model at `name`, refused by what its config.json (and its run's recipe.yaml) say before
    any weight loads; its separator the one it was trained at unless `separator` is given."""
    problems = reward_model_problems(name, "MODEL", ProcessOptions(aggregate="min", step_separator=separator))
    if problems:
        said = [message.replace("set step_separator", "give --separator") for _, message in problems]
        raise RewardError("; ".join(said))
    section = ModelSection(name_or_path=name, dtype="float32", trust_remote_code=trust_remote_code)
    own = load_tokenizer(section)
    if separator is None:  # reward_model_problems refused a model without one of its run's
        separator = trained_separator(model_folder(name))
    return ProcessRewardModel(name, "MODEL", own, None, bool(own.chat_template), section, "min", separator)


def is_process_model(name: str) -> bool:
    """Whether the model at `name` is a token classifier (a process reward model), from its config.json alone."""
    folder = model_folder(name)
    try:
        with open(os.path.join(folder or "", "config.json"), encoding="utf-8") as fh:
            architectures = json.load(fh).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False  # what it is not is said by the outcome scorer's checks
    return any(isinstance(a, str) and a.endswith("ForTokenClassification") for a in architectures)


def step_rows(path: str, subset_column: str | None) -> tuple[list[dict], list[str], list[str]]:
    """(each row checked: prompt, completions, labels; each row's subset; each row's name: file and line)."""
    rows, subsets, places = [], [], []
    for where, row in read_rows(DataSource(path=path), KEY).iterate():
        try:
            rows.append(steps_of_row(row, {}))
        except DataError as e:
            raise DataError(f"{KEY}: {where}: {e}") from None
        subsets.append(subset_of(row, subset_column, where))
        places.append(where)
    return rows, subsets, places


def judged(prm: ProcessRewardModel, rows: list[dict], places: list[str],
           device: torch.device) -> list[list[tuple[bool, bool]]]:
    """Per row, per step: (judged correct: label 1 more probable, labelled correct)."""
    prm.load(device)
    tokenised = []
    for row, where in zip(rows, places):
        try:
            tokenised.append(tokenised_steps(row, prm.tokenizer, prm.separator, {}))
        except DataError as e:
            raise DataError(f"{KEY}: {where}: {e}") from None
    scores = prm.step_scores([(t["input_ids"], t["step_ends"]) for t in tokenised])
    return [[(p > 0.5, bool(label)) for p, label in zip(probs, t["step_labels"])]
            for probs, t in zip(scores, tokenised)]


def figures(rows: list[list[tuple[bool, bool]]]) -> StepScore:
    """A group of rows' figures from their judged steps, as the run's held-out ones (figures.step_figures)."""
    steps = [step for row in rows for step in row]
    counts = (sum(p == t for p, t in steps), sum(p and t for p, t in steps), sum(p and not t for p, t in steps),
              sum(t and not p for p, t in steps))
    return StepScore(len(rows), len(steps), *step_figures(len(steps), *counts))


def score_steps(model_name: str, path: str, subset_column: str | None = None, separator: str | None = None,
                trust_remote_code: bool = False, device: str | None = None) -> dict[str, StepScore]:
    """The step scores of the process reward model at `model_name` on the stepwise rows at `path`."""
    existing(path, "stepwise rows (prompt, completions, labels)")
    prm = checked_prm(model_name, separator, trust_remote_code)
    rows, subsets, places = step_rows(path, subset_column)
    return per_subset(judged(prm, rows, places, device_of(device)), subsets, figures)
