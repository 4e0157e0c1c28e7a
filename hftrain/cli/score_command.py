"""`hftrain score MODEL ROWS`: a reward model scored on rows outside its run (methods/reward/pair_scores.py for an
outcome model, step_scores.py for a process model), the table printed and, with --output, written as JSON; with
--policy, best-of-n sampling of that policy judged by the reward model (methods/reward/best_of_n.py)."""

from __future__ import annotations

import json
from dataclasses import asdict

from ..errors import RewardError
from ..fileio import atomic_write
from ..methods.reward.best_of_n import Sampling, as_lines, best_of_n
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


def _best_of_n(ns) -> int:
    if ns.best_of < 2:
        raise RewardError(f"--best-of {ns.best_of}: at least 2 samples per prompt")
    if ns.subset or ns.separator:
        raise RewardError("--subset and --separator score rows; best-of-n (--policy) takes neither: remove them")
    sampling = Sampling(ns.best_of, ns.max_new_tokens, ns.temperature, ns.seed)
    result, records = best_of_n(ns.model, ns.policy, ns.data, sampling, ns.trust_remote_code, ns.device)
    print(f"hftrain: best of {ns.best_of} samples of {ns.policy} per prompt of {ns.data}, judged by {ns.model}")
    for name, value in asdict(result).items():
        print(f"  {name.replace('_', ' '):<18} {'-' if value is None else round(value, 4)}")
    if ns.output:
        summary = {"model": ns.model, "policy": ns.policy, "data": ns.data, "sampling": asdict(sampling),
                   "best_of_n": asdict(result)}
        atomic_write(ns.output, json.dumps(summary, indent=1) + "\n")
        print(f"hftrain: written to {ns.output}")
    if ns.samples:
        atomic_write(ns.samples, as_lines(records))
        print(f"hftrain: each prompt's samples, scores and best in {ns.samples}")
    return 0


def _score(ns) -> int:
    if ns.policy:
        return _best_of_n(ns)
    if ns.samples:
        raise RewardError("--samples: the samples of best-of-n; give --policy POLICY with it")
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
                             "accuracy and F1 on stepwise rows, per subset; or best-of-n of a policy it judges.")
    sc.add_argument("model", help="the reward model's folder (a run's training.output_dir)")
    sc.add_argument("data", help="rows of prompt, chosen and rejected (any layout hftrain reward reads); for a process "
                                 "reward model, stepwise rows (prompt, completions, labels); with --policy, prompts "
                                 "(messages, their answer if any, or prompt rows)")
    sc.add_argument("--subset", help="the rows' column naming each pair's subset (e.g. RewardBench's subset)")
    sc.add_argument("--separator", help="a process reward model's step separator (default: the one its run trained at)")
    sc.add_argument("--output", help="also write the scores to this JSON file")
    sc.add_argument("--device", help="where the model runs (default: cuda when there is one, else cpu)")
    sc.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                    help="allow the model's own code (off unless given)")
    sc.add_argument("--policy", help="best-of-n: sample this policy's answers to the rows' prompts, keep the one the "
                                     "reward model scores highest")
    sc.add_argument("--best-of", dest="best_of", type=int, default=4, help="best-of-n: samples per prompt (default 4)")
    sc.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=64, help="best-of-n: answer length")
    sc.add_argument("--temperature", type=float, default=1.0, help="best-of-n: sampling temperature (default 1.0)")
    sc.add_argument("--seed", type=int, default=0, help="best-of-n: the sampling seed (default 0)")
    sc.add_argument("--samples", help="best-of-n: also write each prompt's samples, scores and best as JSON lines")
    sc.set_defaults(fn=_score)
