"""`hftrain score RM PROMPTS --policy POLICY --best-of N` (methods/reward/best_of_n.py): each prompt's samples scored
by the reward model as TRL's RewardTrainer renders a conversation for training (its own _prepare_dataset, each sample
scored alone here: the oracle), the best the highest of those, the figures the means of what was written."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hftrain.cli import main
from hftrain.methods.reward.reward_pairs import trl_tokenised
from tests.exactness import within

from .conftest import DEMO_EVAL
from .support import scrambled
from .test_score import reward_model  # noqa: F401  (the module's fixture: a tiny outcome reward model)

PROMPTS = 4
N = 4


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tmp_path_factory):
    """A policy whose samples differ (the tiny model as built answers with blank lines)."""
    return scrambled(tiny_model_dir, str(tmp_path_factory.mktemp("policy")), seed=0)


def oracle_scores(folder: str, prompt: list, samples: list[str]) -> list[float]:
    """Each sample's score, rendered by TRL's RewardTrainer as for training, scored alone."""
    rows = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": s}],
             "rejected": [{"role": "assistant", "content": s + " x"}]} for s in samples]
    prepared = trl_tokenised(datasets.Dataset.from_list(rows), AutoTokenizer.from_pretrained(folder), None, "oracle")
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids in prepared["chosen_ids"]]


def test_best_of_n_keeps_the_sample_the_reward_model_scores_highest(reward_model, policy, tmp_path,  # noqa: F811
                                                                    capsys):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(open(DEMO_EVAL, encoding="utf-8").readlines()[:PROMPTS]))
    argv = ["score", reward_model, str(rows), "--policy", policy, "--best-of", str(N), "--max-new-tokens", "6",
            "--samples", str(tmp_path / "samples.jsonl"), "--output", str(tmp_path / "best.json"), "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / "samples.jsonl", encoding="utf-8")]
    assert len(records) == PROMPTS and all(len(r["samples"]) == N for r in records)
    assert any(len(set(r["samples"])) > 1 for r in records), "the samples must differ"
    for record in records:
        want = oracle_scores(reward_model, record["prompt"], record["samples"])
        within("reward.padded_batch_vs_alone.scores", torch.tensor(record["scores"]), torch.tensor(want), scale=1.0,
               label="best-of-n's scores vs TRL's rendering, each alone")
        assert record["best"] == max(range(N), key=want.__getitem__)
        assert record["prompt"][-1]["role"] == "user" and record["answer"]
    figures = json.load(open(tmp_path / "best.json"))["best_of_n"]
    assert figures["prompts"] == PROMPTS and figures["samples"] == N
    assert figures["mean_first_score"] == pytest.approx(sum(r["scores"][0] for r in records) / PROMPTS)
    assert figures["mean_best_score"] == pytest.approx(sum(r["scores"][r["best"]] for r in records) / PROMPTS)
    assert figures["mean_best_score"] > figures["mean_first_score"]
    assert figures["first_exact_match"] == 0.0 and figures["best_exact_match"] == 0.0  # a random policy
    assert f"mean best score    {round(figures['mean_best_score'], 4)}" in printed
    # The same seed draws the same samples.
    assert main(argv[:-4] + ["--samples", str(tmp_path / "again.jsonl"), "--device", "cpu"]) == 0
    assert [json.loads(line)["samples"] for line in open(tmp_path / "again.jsonl")] == [r["samples"] for r in records]


def test_best_of_n_refuses_what_it_cannot_take(reward_model, policy, tmp_path, capsys):  # noqa: F811
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "assistant", "content": "no prompt"}]}) + "\n")
    for argv, said in (([str(rows), "--policy", policy, "--best-of", "1"], "--best-of 1: at least 2 samples"),
                       ([str(rows), "--samples", str(tmp_path / "s.jsonl")], "--samples: the samples of best-of-n"),
                       ([str(rows), "--policy", policy], "prompts.jsonl:1: no prompt")):
        with pytest.raises(SystemExit) as stop:
            main(["score", reward_model, *argv, "--device", "cpu"])
        assert stop.value.code == 2
        assert said in capsys.readouterr().err
