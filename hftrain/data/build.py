"""Building the training and eval datasets of a recipe: every source read, rendered, checked, mixed."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import datasets
from datasets.fingerprint import Hasher

from ..config import DataSection, DataSource
from ..distributed import main_process_first
from ..errors import DataError
from ..fileio import free_bytes, is_no_space
from .collate import make_collator
from .layouts import content_text, read_canonical
from .render import tokenize_examples, trainable_tokens
from .split import held_out_split

# The columns of a source's canonical dataset: the example as JSON text (Arrow would merge the keys of every row's
# tool arguments into one struct), and where it came from in the user's numbering (removed before training).
CANON, WHERE = "canonical", "where"


@dataclass
class Datasets:
    train: Any
    eval: Any | None
    collator: Callable
    eval_examples: list[dict]  # canonical held-out examples (prompt + reference) for generation metrics


def train_on_prompt(fmt: str, cfg: DataSection, tokenizer, key: str) -> bool:
    """Whether a layout trains on every token (else only on the assistant turns or the completion)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if fmt in ("messages", "sharegpt") and not has_template:
        raise DataError(
            f"{key}: {'messages' if fmt == 'messages' else 'sharegpt conversations'} need a chat template and the "
            "tokenizer has none; set data.chat_template "
            "(a Jinja string or a .jinja file)"
        )
    return {
        "messages": not cfg.assistant_only_loss,
        "sharegpt": not cfg.assistant_only_loss,
        "alpaca": not (cfg.assistant_only_loss if has_template else cfg.completion_only_loss),
        "prompt_completion": not cfg.completion_only_loss,
        "text": True,
    }[fmt]


def _tokenize_source(ds, fmt: str, tokenizer, cfg: DataSection, key: str, src: DataSource):
    on_prompt = train_on_prompt(fmt, cfg, tokenizer, key)
    max_length, drop = cfg.max_length, cfg.truncation == "drop"

    def fn(batch):
        """A batch of canonical rows -> their examples: tokenize_examples gives one row's (one, or several when the
        template rewrites earlier turns), each keeping its row's WHERE. A template's refusal names the key and the
        file's own row: 'data.sources.0 (train.jsonl:12)'."""
        out = {"input_ids": [], "labels": [], WHERE: [], "too_long": [], "n_trainable": []}
        for canon, where in zip(batch[CANON], batch[WHERE]):
            for ex in tokenize_examples(json.loads(canon), tokenizer, on_prompt, cfg.chat_template_kwargs,
                                        f"{key} ({where})", cfg.train_turns):
                n = len(ex["input_ids"])
                if not drop:
                    ex = {k: v[:max_length] for k, v in ex.items()}
                out["input_ids"].append(ex["input_ids"])
                out["labels"].append(ex["labels"])
                out[WHERE].append(where)
                out["too_long"].append(n > max_length)
                out["n_trainable"].append(trainable_tokens(ex["labels"]))
        return out

    # The canonical dataset lives in memory, where datasets caches nothing: name the cache file by the data's content
    # fingerprint and the function (tokenizer and settings), so the main process tokenises and the others read it.
    cache = os.path.join(datasets.config.HF_DATASETS_CACHE, "hftrain",
                         f"tokenised-{Hasher.hash((ds._fingerprint, fn))}.arrow")
    folder = os.path.dirname(cache)
    with main_process_first():
        os.makedirs(folder, exist_ok=True)
        tok = in_cache(folder, key, ds, lambda: ds.map(fn, batched=True, remove_columns=[CANON, WHERE],
                                                        num_proc=cfg.num_proc, cache_file_name=cache,
                                                        desc=f"Tokenising {src.path}"))
    if drop:
        tok = in_cache(folder, key, ds, lambda: tok.filter(lambda r: not r, input_columns="too_long"))
        if len(tok) == 0:
            raise DataError(f"{key}: every example of {src.path} is longer than data.max_length={max_length}; "
                            "raise data.max_length, or set data.truncation: right to cut them")
    bad = [r for r, n in zip(tok[WHERE], tok["n_trainable"]) if n == 0]
    if bad:
        if not cfg.skip_untrainable:
            shown = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise DataError(
                f"{key}: {len(bad)} of {len(tok)} examples of {src.path} have no trainable token ({shown}) "
                f"after masking and truncation to data.max_length={max_length}. Raise data.max_length, "
                "fix those rows, or set data.skip_untrainable: true to drop them"
            )
        tok = in_cache(folder, key, ds, lambda: tok.filter(lambda n: n > 0, input_columns="n_trainable"))
        if len(tok) == 0:
            raise DataError(f"{key}: no example of {src.path} has a trainable token")
    return tok.remove_columns(["too_long", "n_trainable", WHERE])


def in_cache(folder: str, key: str, ds, work: Callable):
    """work() (a datasets map or filter writing its cache under `folder`), with a full disk told clearly: the
    temporary files datasets leaves (it writes `tmp*` beside the cache file and renames it when done; on an error
    the partial file stays) are removed, and the error names the folder, the free space, a rough need and where
    else to put the cache. Not a context manager: its __exit__ would keep the failed writer (and its open file)
    alive while the files are removed, and a deleted open file keeps its space."""
    start, free = time.time() - 1, None
    try:
        return work()
    except Exception as e:
        free = free_bytes(folder)
        if not is_no_space(e, free):
            raise
    gc.collect()  # the failed writer's frames, released with the exception: closes its file
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith("tmp") and os.path.isfile(path) and os.path.getmtime(path) >= start:
                os.remove(path)
    need = 4 * ds.data.nbytes  # token ids, labels and masks of every row: a few times the rows' own size
    raise DataError(f"{key}: no space left in the datasets cache {folder} ({(free or 0) >> 10} KiB free; the "
                    f"tokenised data needs roughly {max(need >> 20, 1)} MiB): free space there, or point "
                    "HF_DATASETS_CACHE at a larger disk")


def canonical_source(src: DataSource, key: str, has_template: bool):
    """(dataset of CANON and WHERE, layout) of one source, every row checked (errors name the file and row)."""
    fmt, rows = read_canonical(src, key, has_template)
    return datasets.Dataset.from_dict({CANON: [json.dumps(c) for _, c in rows], WHERE: [w for w, _ in rows]}), fmt


def _canonical_eval(ds, n: int) -> list[dict]:
    """Held-out examples split into what the model sees and the reference answer."""
    out = []
    for ex in ds.select(range(min(n, len(ds)))):
        canon = json.loads(ex[CANON])
        if "messages" in canon and canon["messages"] and canon["messages"][-1]["role"] == "assistant":
            out.append({"messages": canon["messages"][:-1],
                        "reference": content_text(canon["messages"][-1]["content"])})
        elif "prompt" in canon:
            out.append({"prompt": canon["prompt"], "reference": canon["completion"]})
    return out


def build_datasets(cfg: DataSection, tokenizer, seed: int = 42, exact_match: int = 0) -> Datasets:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    train_parts, eval_parts, weights, eval_examples = [], [], [], []
    for i, src in enumerate(cfg.sources):
        key = f"data.sources.{i}"
        ds, fmt = canonical_source(src, key, has_template)
        if cfg.eval_fraction > 0:
            ds, held = held_out_split(ds, cfg.eval_fraction, seed, key, src.path)
            eval_parts.append(_tokenize_source(held, fmt, tokenizer, cfg, key, src))
            eval_examples += _canonical_eval(held, exact_match)
        train_parts.append(_tokenize_source(ds, fmt, tokenizer, cfg, key, src))
        weights.append(src.weight)
    for i, src in enumerate(cfg.eval_sources):
        key = f"data.eval_sources.{i}"
        ds, fmt = canonical_source(src, key, has_template)
        eval_parts.append(_tokenize_source(ds, fmt, tokenizer, cfg, key, src))
        eval_examples += _canonical_eval(ds, exact_match - len(eval_examples))
    train = mix(train_parts, weights, seed)
    evald = datasets.concatenate_datasets(eval_parts) if eval_parts else None
    return Datasets(train, evald, make_collator(tokenizer, cfg.packing), eval_examples[:exact_match])


def mix(parts: list, weights: list[float], seed: int):
    """One source as is; several interleaved with probabilities proportional to their weights, until every source
    has been seen whole (datasets' `all_exhausted`)."""
    if len(parts) == 1:
        return parts[0]
    total = sum(weights)
    return datasets.interleave_datasets(
        parts, probabilities=[w / total for w in weights], seed=seed, stopping_strategy="all_exhausted"
    )


