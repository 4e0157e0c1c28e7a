"""Which rows are held out never depends on data.max_length: pairs (DPO, outcome reward models) and step rows
(process reward models) are split off first and measured after, so a shorter max_length leaves the same held-out rows
but for those now too long (it changed the held-out set: rows were dropped before the split, and the permutation fell
on other rows)."""

import json
import re

import pytest

from hftrain.methods import load_recipe
from hftrain.methods.preference.dpo import read_pairs as read_pairs_for_dpo
from hftrain.methods.reward.reward_pairs import read_reward_pairs
from hftrain.methods.reward.step_rows import build_step_data


def _pairs(path, n=40):
    with open(path, "w") as fh:
        for i in range(n):  # every fourth pair long: its prompt alone is past the short max_length
            prompt = f"row {i} " + ("x y z " * 20 if i % 4 == 0 else "")
            fh.write(json.dumps({"prompt": prompt, "chosen": f" yes {i}", "rejected": f" no {i}"}) + "\n")
    return str(path)


def _steps(path, n=40):
    with open(path, "w") as fh:
        for i in range(n):
            steps = [f"step {i}"] + (["a b c d e f g h"] * 6 if i % 4 == 0 else [])
            fh.write(json.dumps({"prompt": f"row {i}", "completions": steps, "labels": [True] * len(steps)}) + "\n")
    return str(path)


def _held(read, tokenizer, path, tmp_path, max_length, extra=()):
    recipe = load_recipe(None, [f"data.max_length={max_length}", *extra],
                         raw={"model": {"name_or_path": "m"}, "data": {"sources": [{"path": path}],
                                                                       "eval_fraction": 0.25}})
    return read(recipe, tokenizer)


def _texts(rows, tokenizer) -> list[str]:
    """Each held-out row's text: DPO's pairs keep their prompt, a reward model's are tokenised by TRL."""
    if "prompt" in rows.column_names:
        return rows["prompt"]
    return [tokenizer.decode(ids) for ids in rows["chosen_ids"]]


def _row_numbers(texts) -> set[int]:
    return {int(re.match(r"\d+", t.split("row ", 1)[1]).group()) for t in texts}


@pytest.mark.parametrize("method", ["dpo", "reward"])
def test_held_out_pairs_do_not_move_with_max_length(tmp_path, tokenizer, method):
    path = _pairs(tmp_path / "pairs.jsonl")
    extra = ("reward.kind=outcome",) if method == "reward" else ()
    read = ((lambda r, t: read_reward_pairs(r, t, 1, 0)) if method == "reward"
            else (lambda r, t: read_pairs_for_dpo(r, t, 1, 0)))
    long, short = (_held(read, tokenizer, path, tmp_path, n, extra) for n in (512, 24))
    wide, narrow = (_row_numbers(_texts(d.eval, tokenizer)) for d in (long, short))
    assert len(wide) == 10 and narrow < wide  # the same held-out rows, less the long ones
    assert wide - narrow == {r for r in wide if r % 4 == 0}


def test_held_out_step_rows_do_not_move_with_max_length(tmp_path, tokenizer):
    path = _steps(tmp_path / "steps.jsonl")
    read = lambda r, t: build_step_data(r, t, 0)  # noqa: E731
    long, short = (_held(read, tokenizer, path, tmp_path, n, ("reward.kind=process",)) for n in (512, 40))
    wide, narrow = (_row_numbers(tokenizer.decode(ids) for ids in d.eval["input_ids"]) for d in (long, short))
    assert len(wide) == 10 and narrow < wide
    assert wide - narrow == {r for r in wide if r % 4 == 0}
