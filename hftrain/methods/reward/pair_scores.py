"""`hftrain score MODEL PAIRS`, after a run: an outcome reward model scored on preference pairs outside its run. Each
pair is read as the training data phase reads it (methods/pairs.py: every layout DPO and `hftrain reward` take), each
side scored as the model was trained to read it (methods/reward_reading.py, through methods/reward_model.py's
RewardModel: the scorer GRPO's `grpo.rewards: [{model: ...}]` uses too, so the three agree), then per subset (a
column of the rows, RewardBench's `subset`) the pairs, the share whose chosen side scores higher (pair accuracy, as
the run's eval_pair_accuracy) and the mean margin score(chosen) - score(rejected).

Written here because no library does it for a local model and local rows: RewardBench's own script downloads its
dataset and loads models through its own pipelines; TRL's RewardTrainer evaluates only inside a training run."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from ...config import DataSource, ModelSection
from ...data import read_rows
from ...errors import DataError, RewardError
from ...modeling import load_tokenizer
from ..reward_model import ProcessOptions, RewardModel, reward_model_problems
from ..pairs import read_pairs

KEY = "data"  # how the pairs are named in messages (`data: rows.jsonl:3: chosen is empty ...`)
ALL = "all"


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


def subset_of(row: dict, column: str | None, where: str) -> str:
    """A row's subset: the value of `column`, or ALL when no column is given."""
    if column is None:
        return ALL
    if column not in row:
        raise DataError(f"{KEY}: {where}: no {column!r} column (the row has {list(row)}); name the rows' subset "
                        "column with --subset, or leave it out to score every row as one set")
    return str(row[column])


def subsets_of(path: str, column: str | None, count: int) -> list[str]:
    """Each row's subset (subset_of)."""
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


def summary(margins: list[float], subsets: list[str]) -> dict[str, SubsetScore]:
    """Per subset (in first-seen order) and over ALL pairs: pairs, pair accuracy (margin > 0), mean margin."""
    groups: dict[str, list[float]] = {}
    for margin, subset in zip(margins, subsets):
        groups.setdefault(subset, []).append(margin)
    groups[ALL] = list(margins)
    return {name: SubsetScore(len(m), sum(x > 0 for x in m) / len(m), sum(m) / len(m)) for name, m in groups.items()}


def score_pairs(model_name: str, path: str, subset_column: str | None = None, trust_remote_code: bool = False,
                device: str | None = None) -> tuple[dict[str, SubsetScore], list[float]]:
    """(the scores per subset and over all pairs, each pair's margin) of the reward model at `model_name` on the
    preference rows at `path`."""
    if not os.path.exists(path):
        raise DataError(f"{KEY}: {path} does not exist; give a local file of preference rows (prompt, chosen, "
                        "rejected) or a saved dataset folder")
    model = checked_model(model_name, trust_remote_code)
    pairs, _ = read_pairs(DataSource(path=path), KEY)
    subsets = subsets_of(path, subset_column, len(pairs))
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    margins = pair_margins(model, pairs, where)
    return summary(margins, subsets), margins


def table(scores: dict[str, SubsetScore]) -> str:
    """The scores as the command prints them: one line per subset, ALL last."""
    width = max(len("subset"), *(len(name) for name in scores))
    lines = [f"{'subset':<{width}}  {'pairs':>6}  {'pair accuracy':>13}  {'mean margin':>11}"]
    for name in [n for n in scores if n != ALL] + [ALL]:
        s = scores[name]
        lines.append(f"{name:<{width}}  {s.pairs:>6}  {s.pair_accuracy:>13.4f}  {s.mean_margin:>11.4f}")
    return "\n".join(lines)


def as_json(model_name: str, path: str, scores: dict[str, SubsetScore]) -> dict:
    return {"model": model_name, "data": path, "subsets": {name: asdict(s) for name, s in scores.items()}}
