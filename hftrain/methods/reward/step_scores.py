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
from dataclasses import asdict, dataclass

import torch

from ...config import DataSource, ModelSection
from ...data import read_rows
from ...errors import DataError, RewardError
from ...modeling import load_tokenizer
from ..process_reward_model import ProcessRewardModel
from ..reward_model import ProcessOptions, model_folder, reward_model_problems, trained_separator
from .pair_scores import ALL, KEY, subset_of
from .step_rows import steps_of_row, tokenised_steps


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
    trained = trained_separator_of(name)
    return ProcessRewardModel(name, "MODEL", own, None, bool(own.chat_template), section, "min",
                              separator if separator is not None else trained)


def trained_separator_of(name: str) -> str | None:
    folder = model_folder(name)
    return trained_separator(folder) if folder else None


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


def summary(judgements: list[list[tuple[bool, bool]]], subsets: list[str]) -> dict[str, StepScore]:
    """Per subset (first-seen order) and over ALL rows: rows, steps, step accuracy, correct-step F1."""
    groups: dict[str, list[list[tuple[bool, bool]]]] = {}
    for row, subset in zip(judgements, subsets):
        groups.setdefault(subset, []).append(row)
    groups[ALL] = list(judgements)
    out = {}
    for name, rows in groups.items():
        steps = [step for row in rows for step in row]
        tp = sum(p and t for p, t in steps)
        fp = sum(p and not t for p, t in steps)
        fn = sum(t and not p for p, t in steps)
        out[name] = StepScore(len(rows), len(steps), sum(p == t for p, t in steps) / len(steps),
                              2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return out


def score_steps(model_name: str, path: str, subset_column: str | None = None, separator: str | None = None,
                trust_remote_code: bool = False, device: str | None = None) -> dict[str, StepScore]:
    """The step scores of the process reward model at `model_name` on the stepwise rows at `path`."""
    if not os.path.exists(path):
        raise DataError(f"{KEY}: {path} does not exist; give a local file of stepwise rows (prompt, completions, "
                        "labels) or a saved dataset folder")
    prm = checked_prm(model_name, separator, trust_remote_code)
    rows, subsets, places = step_rows(path, subset_column)
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return summary(judged(prm, rows, places, where), subsets)


def step_table(scores: dict[str, StepScore]) -> str:
    width = max(len("subset"), *(len(name) for name in scores))
    lines = [f"{'subset':<{width}}  {'rows':>6}  {'steps':>6}  {'step accuracy':>13}  {'step F1':>7}"]
    for name in [n for n in scores if n != ALL] + [ALL]:
        s = scores[name]
        lines.append(f"{name:<{width}}  {s.rows:>6}  {s.steps:>6}  {s.step_accuracy:>13.4f}  {s.step_f1:>7.4f}")
    return "\n".join(lines)


def step_json(model_name: str, path: str, scores: dict[str, StepScore]) -> dict:
    return {"model": model_name, "data": path, "kind": "process",
            "subsets": {name: asdict(s) for name, s in scores.items()}}
