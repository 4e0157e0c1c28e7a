"""`hftrain score` (issue 67, item 4): an outcome reward model scored on preference rows outside its run. Each side is
scored as TRL's RewardTrainer tokenises it for training (its own _prepare_dataset, the oracle: each side scored alone
here), pair accuracy and mean margin per subset and over all; what is not an outcome reward model, a missing subset
column and a bad row are refused by name. On a trained run: tests/test_reward.py (the run's own held-out figures)."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hftrain.cli import main
from hftrain.errors import DataError, RewardError
from hftrain.methods.reward.reward_pairs import trl_tokenised
from hftrain.methods.reward.pair_scores import ALL, score_pairs
from tests.exactness import beyond, within

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
    with pytest.raises(DataError, match=r"no 'subset' column .* leave it out to score every pair as one set"):
        score_pairs(reward_model, path, "subset", device="cpu")
    with pytest.raises(RewardError, match="is not a sequence classifier"):
        score_pairs(tiny_model_dir, path, device="cpu")  # a causal LM, not a reward model
    bad = write(tmp_path / "bad.jsonl", [PAIRS[0][0], {**PAIRS[1][0], "rejected": PAIRS[1][0]["chosen"]}])
    with pytest.raises(DataError, match=r"data: .*bad.jsonl:2: chosen equals rejected"):
        score_pairs(reward_model, bad, device="cpu")
    with pytest.raises(DataError, match="does not exist"):
        score_pairs(reward_model, str(tmp_path / "none.jsonl"), device="cpu")
