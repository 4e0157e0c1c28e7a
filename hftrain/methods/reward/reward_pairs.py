"""An outcome reward model's data phase: the preference pairs every layout DPO reads (methods/pairs.py: explicit or
implicit prompt, conversations with the chat template, local files, mixing), tokenised as TRL 1.16's RewardTrainer
tokenises them (its own _prepare_dataset: EOS after text answers, prompt + answer, the chat template for
conversations), before the model loads. What TRL does silently is said here by file and row: it drops every pair with
a side longer than data.max_length (counted and named; none left is an error). The tokenizer's pad token is checked
here too: a sequence classifier reads its score at the last token before padding (config.pad_token_id). How an outcome
reward model reads a pair's side is methods/reward_reading.py's contract, which GRPO's scoring imports: a test holds
it equal to TRL's rendering here."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from trl import RewardTrainer

from ...config import Recipe
from ...data.left_out import none_left, say_left_out
from ...errors import DataError
from ..base import has_template
from ..pairs import ROW, PreferenceData, build_preference_data
from ..reward_reading import score_pad_problem

MARGIN = "margin"  # TRL's column of each pair's margin (RewardTrainer.compute_loss)


def trl_tokenised(ds, tokenizer, max_length: int | None, name: str):
    """The pairs as TRL's RewardTrainer prepares them (called, not re-written: the lengths here are its own); a side
    longer than `max_length` drops the pair. The rows keep ROW, their index in `ds`."""
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length)
    indexed = ds.add_column(ROW, list(range(len(ds))))
    return RewardTrainer._prepare_dataset(None, indexed, tokenizer, args, name)


def measured(ds, places: list[str], tokenizer, max_length: int, key: str, path: str):
    """One source's pairs tokenised; those TRL would drop (a side over data.max_length tokens) are counted and named,
    none left is a DataError naming data.max_length."""
    prepared = trl_tokenised(ds, tokenizer, max_length, key)
    dropped = sorted(set(range(len(ds))) - set(prepared[ROW]))
    if len(dropped) == len(ds):
        every = trl_tokenised(ds, tokenizer, None, key)
        shortest = min(max(len(c), len(r)) for c, r in zip(every["chosen_ids"], every["rejected_ids"]))
        raise none_left(key, path, len(ds), "pairs",
                        f"has a side longer than data.max_length={max_length} tokens, and a reward model scores whole "
                        f"sequences (the shortest pair's longer side has {shortest} tokens)",
                        f"raise data.max_length to {shortest} or more")
    say_left_out(key, path, [places[i] for i in dropped], len(ds), "pairs",
                 f"a side is longer than data.max_length={max_length} tokens")
    return prepared.remove_columns(ROW)


def read_reward_pairs(recipe: Recipe, tokenizer, world_size: int, seed: int) -> PreferenceData:
    """Every pair read, checked and tokenised (errors name the file and row); the tokenizer's pad token and the
    first bad row are refused together."""
    margin = recipe.reward.margin
    where = "model.tokenizer_name_or_path" if recipe.model.tokenizer_name_or_path else "model.name_or_path"
    problems = [p for p in (score_pad_problem(tokenizer, where),) if p]  # where the score is read: reward_reading
    try:  # without a pad token TRL's tokenising is not reached: the rows are still read and checked
        data = build_preference_data(recipe.data, has_template(tokenizer), seed=seed,
                                     tokenizer=None if problems else tokenizer,
                                     measure=measured, keep=(margin,) if margin else ())
    except DataError as e:
        raise DataError("\n".join([*problems, str(e)])) from None
    if problems:
        raise DataError("\n".join(problems))
    if margin and margin != MARGIN:  # TRL reads the margin from its own column name
        data.train = data.train.rename_column(margin, MARGIN)
        data.eval = data.eval.rename_column(margin, MARGIN) if data.eval is not None else None
    return data


def show_pairs(recipe: Recipe, tokenizer, n: int) -> str:
    """The first n training pairs as `hftrain data` shows them: the texts and each side's length in tokens."""
    data = read_reward_pairs(recipe, tokenizer, 1, recipe.typed_training.seed)
    rows = data.train.select(range(min(n, len(data.train))))
    print(f"hftrain: the first {len(rows)} training pairs (each side as the reward model scores it, in tokens)",
          file=sys.stderr)
    lines = []
    for row in rows:
        shown = {"chosen": tokenizer.decode(row["chosen_ids"]), "rejected": tokenizer.decode(row["rejected_ids"]),
                 "chosen_tokens": len(row["chosen_ids"]), "rejected_tokens": len(row["rejected_ids"])}
        if MARGIN in row:
            shown[MARGIN] = row[MARGIN]
        lines.append(json.dumps(shown, ensure_ascii=False))
    return "\n".join(lines)
