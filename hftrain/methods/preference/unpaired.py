"""Unpaired preference examples (KTO): rows of prompt / completion / label, or pairs split in two.

An unpaired row is text (`{"prompt": "2+2=", "completion": "4", "label": true}`) or a conversation (`prompt` a list of
messages, `completion` the assistant turn(s) that answer it); `label` is a JSON boolean, true for a desirable answer
(thumbs up) and false for an undesirable one. A source of prompt / chosen / rejected pairs (pairs.py's rows,
checked the same way) is split by TRL's `unpair_preference_dataset`: the chosen answer desirable, the rejected one not.

What TRL does not do, done here: refuse a bad row by file and row (a missing or non-boolean label, an empty
completion, text mixed with messages) and a split holding one label only (KTO's loss then has no counterpart: every
example is pushed one way against the KL reference point alone), and shuffle the examples once with the run's seed.
TRL's KTOTrainer trains them in order (it pairs each prompt with the completion of the example before it in a fixed
micro-batch, for its KL estimate) and its unpairing puts the chosen answers of every 1000 pairs before their rejected
ones: unshuffled, whole micro-batches would be of one label, and a KL completion would often answer the same prompt.
"""

from __future__ import annotations

import sys

import datasets
from trl.data_utils import unpair_preference_dataset

from ...config import DataSection, DataSource
from ...data.left_out import first_places, none_left
from ...distributed import print0
from ...errors import DataError
from ..pairs import PreferenceData, check_kind, is_empty, messages_of, pair_of_row
from ...data.sources import column_map, read_rows
from ...data.source_loop import PLACE, read_sources

EXAMPLE = ("prompt", "completion", "label")
POSITION = "__hftrain_position"
LABELS = {True: "desirable", False: "undesirable"}


def example_of_row(row: dict, roles: dict[str, str]) -> dict:
    """The canonical example of one unpaired row ({prompt, completion, label}); a DataError says what is wrong."""
    missing = [c for c in EXAMPLE if c not in row or row[c] is None]
    if missing:
        raise DataError(f"no {' or '.join(repr(c) for c in missing)} column (the row has {list(row)}); an unpaired "
                        "row needs prompt, completion and label (true: desirable, false: undesirable), or a pair "
                        "needs prompt, chosen and rejected (map yours with columns:, e.g. {label: thumbs_up})")
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not isinstance(label, bool):
        raise DataError(f"label must be true or false (a JSON boolean: true for a desirable completion, false for an "
                        f"undesirable one), got {type(label).__name__} {label!r}")
    text = [isinstance(prompt, str), isinstance(completion, str)]
    if all(text):
        example = {"prompt": prompt, "completion": completion, "label": label}
    elif any(text):
        raise DataError("mixes text and message lists between prompt and completion; write both as text, or both as "
                        "lists of messages")
    else:
        prompt, completion = messages_of(prompt, "prompt", roles), messages_of(completion, "completion", roles)
        if completion and completion[0]["role"] != "assistant":
            raise DataError(f"completion must begin with the assistant's answer (role assistant), got role "
                            f"'{completion[0]['role']}'")
        if not prompt:
            raise DataError("prompt is empty: give the turns the completion answers")
        example = {"prompt": prompt, "completion": completion, "label": label}
    if is_empty(example["completion"]):
        raise DataError("completion is empty: an example needs an answer to judge; fix or remove the row")
    return example


def read_unpaired(src: DataSource, key: str, with_rows: bool = False) -> tuple[datasets.Dataset, bool, bool]:
    """The rows of a source as checked (unpaired examples, or pairs: `split_in_two` makes them examples), whether they
    are pairs, and whether they are conversations; the first bad row stops. A source holds either kind, as its first
    row does. `with_rows`: each example's row name in a PLACE column."""
    rows = read_rows(src, key)
    rename = column_map(rows, src, key)
    if rows.count == 0:
        raise DataError(f"{key}.path: {src.path} has no examples")
    out, kinds, first = [], {}, None
    for where, row in rows.iterate():
        row = {rename.get(k, k): v for k, v in row.items()}
        paired = "completion" not in row and ("chosen" in row or "rejected" in row)
        first = first or (paired, where)
        try:
            if paired != first[0]:
                raise DataError(f"is {'a pair' if paired else 'an unpaired example'} but {first[1]} is "
                                f"{'a pair' if first[0] else 'an unpaired example'}; put each kind in a source of its "
                                "own")
            item = pair_of_row(row, src.roles) if paired else example_of_row(row, src.roles)
        except DataError as e:
            raise DataError(f"{key}: {where}: {e}") from None
        kind = not isinstance(item["prompt"], str)
        kinds.setdefault(kind, where)
        if len(kinds) > 1:
            raise DataError(f"{key}: {where}: is {'a conversation' if kind else 'text'} but {kinds[not kind]} is "
                            f"{'text' if kind else 'a conversation'}; put each kind in a source of its own")
        out.append({**item, PLACE: where} if with_rows else item)
    n = len(out) * (2 if first[0] else 1)
    desirable = len(out) if first[0] else sum(e["label"] for e in out)
    print0(f"hftrain: {key} ({src.path}): layout {'preference pairs, split in two' if first[0] else 'unpaired'} "
           f"({'conversations' if kinds.get(True) else 'text'}), {n} examples ({desirable} desirable, "
           f"{n - desirable} undesirable)", file=sys.stderr)
    return datasets.Dataset.from_list(out), first[0], bool(kinds.get(True))


def split_in_two(ds: datasets.Dataset, paired: bool) -> datasets.Dataset:
    """Pairs as examples, by TRL's own split: each pair's chosen answer labelled true, its rejected answer false."""
    return unpair_preference_dataset(ds) if paired else ds


def check_example_lengths(ds: datasets.Dataset, tokenizer, max_length: int, key: str, path: str) -> datasets.Dataset:
    """The examples of one source that truncation to data.max_length leaves something to train on, measured by TRL
    1.16's own KTOTrainer._prepare_dataset (EOS for text, the chat template, dropping every example whose prompt
    alone fills max_length) before the model loads: the ones it drops are counted and named here, none left is a
    DataError naming data.max_length (the run would otherwise end with exit 0 having trained on nothing)."""
    from types import SimpleNamespace

    from trl import KTOTrainer  # heavy import: KTO runs only

    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, per_device_train_batch_size=1)
    trainer = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False)
    indexed = ds.add_column(POSITION, list(range(len(ds))))
    kept = KTOTrainer._prepare_dataset(trainer, indexed, tokenizer, args, key)[POSITION]
    dropped = sorted(set(range(len(ds))) - set(kept))
    names = ds[PLACE]
    if not kept:
        unbounded = KTOTrainer._prepare_dataset(trainer, indexed, tokenizer, SimpleNamespace(**{
            **vars(args), "max_length": None}), key)
        shortest = min(len(ids) for ids in unbounded["prompt_ids"])
        raise none_left(key, path, len(ds), "examples",
                        f"has a prompt of data.max_length={max_length} tokens or more, so truncation would leave none "
                        f"of their completions to train on (the shortest prompt has {shortest} tokens)",
                        f"raise data.max_length above {shortest}")
    if dropped:  # a pair split in two is one place: named once
        print0(f"hftrain: {key}: {len(dropped)} of {len(ds)} examples of {path} are left out: their prompt alone "
               f"fills data.max_length={max_length} tokens, so nothing of their completions would be trained "
               f"({first_places(list(dict.fromkeys(names[i] for i in dropped)))}); raise data.max_length to keep "
               "them", file=sys.stderr)
    return ds.select(kept) if dropped else ds


def _both_labels(ds: datasets.Dataset, key: str, fix: str) -> None:
    labels = set(ds["label"])
    if len(labels) < 2:
        only = LABELS[labels.pop()]
        raise DataError(f"{key}: every example ({len(ds)}) is {only} (label {str(only == 'desirable').lower()}): KTO "
                        f"weighs desirable against undesirable examples and needs both; {fix}")


def build_unpaired_data(cfg: DataSection, has_template: bool, seed: int = 42, tokenizer=None) -> PreferenceData:
    """Every source read and checked, held-out examples split off (data.eval_fraction) or read (data.eval_sources),
    the training sources mixed by weight; both splits shuffled with `seed` (the module docstring says why). With the
    run's `tokenizer`, each source's examples are also measured as TRL will truncate them (check_example_lengths),
    before any model is loaded, and both labels must be left."""
    kinds: dict = {}
    paired_of: dict[str, bool] = {}

    def read(src: DataSource, key: str, group: str) -> datasets.Dataset:
        ds, paired_of[key], conversational = read_unpaired(src, key, with_rows=True)
        check_kind(kinds, key, conversational, has_template, "examples")
        if conversational and cfg.chat_template_kwargs:  # TRL passes a row's chat_template_kwargs to the template
            ds = ds.add_column("chat_template_kwargs", [cfg.chat_template_kwargs] * len(ds))
        return ds

    def finish(ds: datasets.Dataset, key: str, src: DataSource) -> datasets.Dataset:
        """Pairs are held out whole (no prompt's answers on both sides), then split in two and measured."""
        examples = split_in_two(ds, paired_of[key])
        if tokenizer is not None:
            examples = check_example_lengths(examples, tokenizer, cfg.max_length, key, src.path)
        return examples.remove_columns(PLACE)

    split = read_sources(cfg, seed, read, finish)
    eval_parts = split.held
    train = split.train.shuffle(seed=seed)
    _both_labels(train, "data.sources", "add examples of the other label, or train with a paired loss on pairs")
    evald = None
    if eval_parts:
        evald = datasets.concatenate_datasets(eval_parts).shuffle(seed=seed)
        _both_labels(evald, "data.eval_sources" if cfg.eval_sources else "data.eval_fraction",
                     "hold out examples of both labels")
    return PreferenceData(train, evald, bool(kinds.get(True)))
