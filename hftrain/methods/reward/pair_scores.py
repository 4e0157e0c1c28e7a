"""`hftrain score MODEL PAIRS`, after a run: an outcome reward model scored on preference pairs outside its run. Each
pair is read as the training data phase reads it (methods/pairs.py: every layout DPO and `hftrain reward` take), each
side scored as the model was trained to read it (methods/reward_reading.py, through methods/reward_model.py's
RewardModel: the scorer GRPO's `grpo.rewards: [{model: ...}]` uses too, so the three agree), then per subset (a
column of the rows, RewardBench's `subset`) the pairs, the share whose chosen side scores higher (pair accuracy, as
the run's eval_pair_accuracy) and the mean margin score(chosen) - score(rejected).

Written here because no library does it for a local model and local rows: RewardBench's own script downloads its
dataset and loads models through its own pipelines; TRL's RewardTrainer evaluates only inside a training run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import DataSource, ModelSection
from ...data import read_rows
from ...errors import RewardError
from ...modeling import load_tokenizer
from ..pairs import read_pairs
from ..reward_model import ProcessOptions, RewardModel, reward_model_problems
from .figures import pair_figures
from .subsets import ALL, KEY, device_of, existing, per_subset, subset_of


@dataclass(frozen=True)
class SubsetScore:
    pairs: int
    pair_accuracy: float
    mean_margin: float


def checked_model(name: str, trust_remote_code: bool) -> RewardModel:
    """The reward model at `name`, refused by what its config.json says before any weight loads: an outcome reward
    model (a sequence classifier with one label) only."""
    problems = reward_model_problems(name, "MODEL", ProcessOptions())
    if problems:
        raise RewardError("; ".join(message for _, message in problems))
    section = ModelSection(name_or_path=name, dtype="float32", trust_remote_code=trust_remote_code)
    own = load_tokenizer(section)  # its own tokenizer: each side rendered with it and its chat template
    return RewardModel(name, "MODEL", own, None, conversational=bool(own.chat_template), cfg=section)


def subsets_of(path: str, column: str | None, count: int) -> list[str]:
    """Each row's subset (subsets.subset_of)."""
    if column is None:
        return [ALL] * count
    return [subset_of(row, column, where) for where, row in read_rows(DataSource(path=path), KEY).iterate()]


def pair_margins(model: RewardModel, pairs: list[dict], device: torch.device) -> list[float]:
    """score(chosen) - score(rejected) of each pair."""
    model.load(device)
    prompts = [p["prompt"] for p in pairs]
    chosen = model.score_ids(model.render(prompts, [p["chosen"] for p in pairs]))
    rejected = model.score_ids(model.render(prompts, [p["rejected"] for p in pairs]))
    return [c - r for c, r in zip(chosen, rejected)]


def figures(margins: list[float]) -> SubsetScore:
    """A group of pairs' figures, as the run's held-out ones (figures.pair_figures)."""
    return SubsetScore(len(margins), *pair_figures(torch.tensor(margins, dtype=torch.float64)))


def score_pairs(model_name: str, path: str, subset_column: str | None = None, trust_remote_code: bool = False,
                device: str | None = None) -> tuple[dict[str, SubsetScore], list[float]]:
    """(the scores per subset and over all pairs, each pair's margin) of the reward model at `model_name` on the
    preference rows at `path`."""
    existing(path, "preference rows (prompt, chosen, rejected)")
    model = checked_model(model_name, trust_remote_code)
    pairs, _ = read_pairs(DataSource(path=path), KEY)
    subsets = subsets_of(path, subset_column, len(pairs))
    margins = pair_margins(model, pairs, device_of(device))
    return per_subset(margins, subsets, figures), margins
