"""The held-out figures of a reward run, computed once for the trainers (outcome.py, process.py) and for
`hftrain score` (pair_scores.py, step_scores.py). A module of its own so that the score command, like every
command but a run, imports no TRL trainer (tests/test_lazy_imports.py)."""

from __future__ import annotations

import torch


def pair_figures(margin: torch.Tensor) -> tuple[float, float]:
    """(pair accuracy: the share of pairs whose chosen side scores higher, mean margin) of pairs' score(chosen) -
    score(rejected)."""
    return (margin > 0).float().mean().item(), margin.mean().item()


def step_figures(steps: int, correct: int, tp: int, fp: int, fn: int) -> tuple[float, float]:
    """(step accuracy, F1 of the correct-step class) of judged steps' counts."""
    return correct / steps if steps else float("nan"), 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
