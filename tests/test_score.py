"""`hftrain score` (issue 67, item 4): a reward model scored on rows outside its run. An outcome reward model on
preference pairs: each side scored as TRL's RewardTrainer tokenises it for training (its own _prepare_dataset, the
oracle: each side scored alone here), pair accuracy and mean margin per subset and over all. A process reward model
on stepwise rows: each step judged at its separator token as the training data phase tokenises the row, step accuracy
and F1 per subset. What cannot be scored, a missing subset column and a bad row are refused by name. On trained runs:
tests/test_reward.py and tests/test_process_reward.py (the runs' own held-out figures)."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

from hftrain.cli import main
from hftrain.errors import DataError, RewardError
from hftrain.methods.reward.pair_scores import score_pairs
from hftrain.methods.reward.reward_pairs import trl_tokenised
from hftrain.methods.reward.step_rows import tokenised_steps
from hftrain.methods.reward.step_scores import score_steps
from hftrain.methods.reward.subsets import ALL
from tests.exactness import beyond, within

from .test_grpo_reward_model import save_prm

PAIRS = [({"prompt": [{"role": "user", "content": f"reverse: {w}"}],
           "chosen": [{"role": "assistant", "content": " ".join(reversed(w.split()))}],
           "rejected": [{"role": "assistant", "content": w}]}, "short" if len(w) < 6 else "long")
         for w in ("a b", "c d e", "f g h i", "j k", "l m n o p", "q r s")]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tiny_model_dir):
    """A tiny outcome reward model (random weights, one label; its config's pad id the tokenizer's)."""
    out = str(tmp_path_factory.mktemp("score") / "rm")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def oracle_margins(folder: str, rows: list[dict], cut: int = 0) -> list[float]:
    """Each pair's margin with its sides tokenised by TRL's RewardTrainer as for training, each scored alone (`cut`:
    that many last tokens dropped, the score read before the turn's end: the control)."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    prepared = trl_tokenised(datasets.Dataset.from_list(rows), tok, None, "oracle")

    def score(ids):
        return model(input_ids=torch.tensor([ids[:len(ids) - cut]])).logits[0, 0]

    with torch.no_grad():
        return [(score(c) - score(r)).item() for c, r in zip(prepared["chosen_ids"], prepared["rejected_ids"])]


def test_each_pair_is_scored_as_trl_trains_it_and_summed_per_subset(reward_model, tmp_path):
    rows = [dict(pair, subset=subset) for pair, subset in PAIRS]
    path = write(tmp_path / "pairs.jsonl", rows)
    scores, margins = score_pairs(reward_model, path, "subset", device="cpu")
    want = oracle_margins(reward_model, [pair for pair, _ in PAIRS])
    within("reward.padded_batch_vs_alone.scores", torch.tensor(margins), torch.tensor(want), scale=1.0,
           label="hftrain score vs TRL's rendering, each alone")
    beyond("reward.padded_batch_vs_alone.scores", torch.tensor(margins),
           torch.tensor(oracle_margins(reward_model, [pair for pair, _ in PAIRS], cut=1)), scale=1.0,
           label="the score read one token before the turn's end")
    for name in ("short", "long", ALL):
        mine = [m for m, (_, s) in zip(want, PAIRS) if name in (s, ALL)]
        assert scores[name].pairs == len(mine)
        assert scores[name].pair_accuracy == sum(m > 0 for m in mine) / len(mine)
        assert scores[name].mean_margin == pytest.approx(sum(mine) / len(mine), abs=1e-5)
    assert 0 < scores[ALL].pair_accuracy < 1  # a random model: the counts above are not all-or-nothing


def test_the_command_prints_the_table_and_writes_the_json(reward_model, tmp_path, capsys):
    path = write(tmp_path / "pairs.jsonl", [dict(pair, subset=subset) for pair, subset in PAIRS])
    assert main(["score", reward_model, path, "--subset", "subset", "--output", str(tmp_path / "s.json"),
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == ["subset", "pairs", "pair", "accuracy", "mean", "margin"]
    assert [line.split()[0] for line in printed[2:5]] == ["short", "long", "all"]
    written = json.load(open(tmp_path / "s.json"))
    assert written["subsets"]["all"]["pairs"] == 6 and set(written["subsets"]) == {"short", "long", "all"}


def test_what_cannot_be_scored_is_refused_by_name(reward_model, tiny_model_dir, tmp_path):
    path = write(tmp_path / "pairs.jsonl", [pair for pair, _ in PAIRS])
    with pytest.raises(DataError, match=r"no 'subset' column .* leave it out to score every row as one set"):
        score_pairs(reward_model, path, "subset", device="cpu")
    with pytest.raises(RewardError, match="is not a sequence classifier"):
        score_pairs(tiny_model_dir, path, device="cpu")  # a causal LM, not a reward model
    bad = write(tmp_path / "bad.jsonl", [PAIRS[0][0], {**PAIRS[1][0], "rejected": PAIRS[1][0]["chosen"]}])
    with pytest.raises(DataError, match=r"data: .*bad.jsonl:2: chosen equals rejected"):
        score_pairs(reward_model, bad, device="cpu")
    with pytest.raises(DataError, match="does not exist"):
        score_pairs(reward_model, str(tmp_path / "none.jsonl"), device="cpu")


# -- a process reward model on stepwise rows ------------------------------------------------------------------------
STEP_ROWS = [({"prompt": "judge:\n", "completions": [" ".join(w) for w in words], "labels": labels}, subset)
             for words, labels, subset in ((("abc",), [True], "one"), (("ab", "cde"), [True, False], "two"),
                                           (("a", "bc", "def"), [False, True, True], "three"),
                                           (("fg", "h"), [False, False], "two"), (("ij",), [True], "one"))]


@pytest.fixture(scope="module")
def prm(tmp_path_factory, tokenizer):
    """A tiny token classifier with two labels and the recipe.yaml naming its separator ("\n"), as a run leaves it."""
    return save_prm(tmp_path_factory.mktemp("score_prm") / "prm", tokenizer)


def oracle_steps(folder: str, rows: list[dict]) -> list[tuple[bool, bool]]:
    """(judged correct, labelled correct) of every step: each row tokenised as the training data phase does, scored
    alone, label 1 more probable at the step's separator token."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForTokenClassification.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for row in rows:
            t = tokenised_steps(row, tok, "\n", {})
            logits = model(input_ids=torch.tensor([t["input_ids"]])).logits[0]
            out += [(bool(logits[end].argmax() == 1), bool(label)) for end, label in zip(t["step_ends"],
                                                                                          t["step_labels"])]
    return out


def accuracy_and_f1(steps: list[tuple[bool, bool]]) -> tuple[float, float]:
    tp = sum(p and t for p, t in steps)
    wrong = sum(p != t for p, t in steps)
    return sum(p == t for p, t in steps) / len(steps), 2 * tp / (2 * tp + wrong) if tp + wrong else 0.0


def test_each_step_is_judged_as_the_run_counts_it(prm, tmp_path):
    path = write(tmp_path / "steps.jsonl", [dict(row, subset=subset) for row, subset in STEP_ROWS])
    scores = score_steps(prm, path, "subset", device="cpu")
    for name in ("one", "two", "three", ALL):
        rows = [row for row, subset in STEP_ROWS if name in (subset, ALL)]
        want = oracle_steps(prm, rows)
        assert (scores[name].rows, scores[name].steps) == (len(rows), len(want))
        assert (scores[name].step_accuracy, scores[name].step_f1) == pytest.approx(accuracy_and_f1(want), abs=1e-12)
    assert 0 < scores[ALL].step_accuracy < 1  # a random model: neither all right nor all wrong


def test_the_command_scores_a_process_model_on_stepwise_rows(prm, tmp_path, capsys):
    path = write(tmp_path / "steps.jsonl", [row for row, _ in STEP_ROWS])
    assert main(["score", prm, path, "--output", str(tmp_path / "s.json"), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == ["subset", "rows", "steps", "step", "accuracy", "step", "F1"]
    written = json.load(open(tmp_path / "s.json"))
    assert written["kind"] == "process" and written["subsets"]["all"]["steps"] == 9


def test_a_process_model_needs_its_separator_and_only_it_takes_one(tokenizer, reward_model, tmp_path, capsys):
    path = write(tmp_path / "steps.jsonl", [row for row, _ in STEP_ROWS])
    unnamed = save_prm(tmp_path / "prm", tokenizer, separator=None)  # no recipe.yaml of a process reward run
    with pytest.raises(RewardError, match="give --separator"):
        score_steps(unnamed, path, device="cpu")
    assert score_steps(unnamed, path, separator="\n", device="cpu")[ALL].steps == 9
    pairs = write(tmp_path / "pairs.jsonl", [pair for pair, _ in PAIRS])
    with pytest.raises(SystemExit) as exited:
        main(["score", reward_model, pairs, "--separator", "\n"])
    assert exited.value.code == 2
    assert "--separator: applies to a process reward model" in capsys.readouterr().err
    broken = write(tmp_path / "broken.jsonl", [STEP_ROWS[0][0], {**STEP_ROWS[1][0], "labels": [True]}])
    with pytest.raises(DataError, match=r"data: .*broken.jsonl:2: 2 steps but 1 labels"):
        score_steps(unnamed, broken, separator="\n", device="cpu")
