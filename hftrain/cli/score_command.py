"""`hftrain score MODEL ROWS`: a reward model scored on rows outside its run (methods/reward/pair_scores.py for an
outcome model, step_scores.py for a process model), the table printed and, with --output, written as JSON."""

from __future__ import annotations

import json

from ..errors import RewardError
from ..fileio import atomic_write
from ..methods.reward.pair_scores import score_pairs
from ..methods.reward.step_scores import is_process_model, score_steps
from ..methods.reward.subsets import as_json, table


def _scores(ns) -> tuple[dict, str]:
    """(the scores per subset, the model's kind): an outcome reward model on pairs, a process reward model (a token
    classifier) on stepwise rows."""
    if is_process_model(ns.model):
        return score_steps(ns.model, ns.data, ns.subset, ns.separator, ns.trust_remote_code, ns.device), "process"
    if ns.separator is not None:
        raise RewardError(f"--separator: applies to a process reward model (a token classifier); {ns.model} is not "
                          "one: remove it")
    return score_pairs(ns.model, ns.data, ns.subset, ns.trust_remote_code, ns.device)[0], "outcome"


def _score(ns) -> int:
    scores, kind = _scores(ns)
    print(f"hftrain: {ns.model} on {ns.data}")
    print(table(scores))
    if ns.output:
        atomic_write(ns.output, json.dumps(as_json(ns.model, ns.data, kind, scores), indent=1) + "\n")
        print(f"hftrain: written to {ns.output}")
    return 0


def add_score_command(sub) -> None:
    sc = sub.add_parser("score", allow_abbrev=False,
                        help="Score a reward model: pair accuracy and mean margin on chosen/rejected rows, or step "
                             "accuracy and F1 on stepwise rows, per subset.")
    sc.add_argument("model", help="the reward model's folder (a run's training.output_dir)")
    sc.add_argument("data", help="rows of prompt, chosen and rejected (any layout hftrain reward reads); for a process "
                                 "reward model, stepwise rows (prompt, completions, labels)")
    sc.add_argument("--subset", help="the rows' column naming each pair's subset (e.g. RewardBench's subset)")
    sc.add_argument("--separator", help="a process reward model's step separator (default: the one its run trained at)")
    sc.add_argument("--output", help="also write the scores to this JSON file")
    sc.add_argument("--device", help="where the model runs (default: cuda when there is one, else cpu)")
    sc.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                    help="allow the model's own code (off unless given)")
    sc.set_defaults(fn=_score)
