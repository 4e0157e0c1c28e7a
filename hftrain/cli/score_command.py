"""`hftrain score MODEL PAIRS`: a reward model scored on chosen/rejected rows (methods/reward/pair_scores.py), the
table printed and, with --output, written as JSON."""

from __future__ import annotations

import json

from ..fileio import atomic_write
from ..methods.reward.pair_scores import as_json, score_pairs, table


def _score(ns) -> int:
    scores, _ = score_pairs(ns.model, ns.data, ns.subset, ns.trust_remote_code, ns.device)
    print(f"hftrain: {ns.model} on {ns.data}")
    print(table(scores))
    if ns.output:
        atomic_write(ns.output, json.dumps(as_json(ns.model, ns.data, scores), indent=1) + "\n")
        print(f"hftrain: written to {ns.output}")
    return 0


def add_score_command(sub) -> None:
    sc = sub.add_parser("score", allow_abbrev=False,
                        help="Score a reward model on chosen/rejected rows: pair accuracy and mean margin per subset.")
    sc.add_argument("model", help="the reward model's folder (a run's training.output_dir)")
    sc.add_argument("data", help="rows of prompt, chosen and rejected (any layout hftrain reward reads)")
    sc.add_argument("--subset", help="the rows' column naming each pair's subset (e.g. RewardBench's subset)")
    sc.add_argument("--output", help="also write the scores to this JSON file")
    sc.add_argument("--device", help="where the model runs (default: cuda when there is one, else cpu)")
    sc.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                    help="allow the model's own code (off unless given)")
    sc.set_defaults(fn=_score)
