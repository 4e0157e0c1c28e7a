"""Pairs with images (an image-text-to-text model tuned on chosen and rejected answers): each row a prompt
conversation with its images and two answers, read and checked before any model loads, in the layouts TRL and the
Hub's vision pair sets (RLAIF-V) use:

- {"images": ["red.png"], "prompt": [{"role": "user", "content": "<image>What colour?"}], "chosen": "red",
  "rejected": "blue"}: an images column and `<image>` markers (a text prompt is one user turn);
- the prompt's content parts naming their files: [{"role": "user", "content": [{"type": "image", "image": "red.png"},
  {"type": "text", "text": "What colour?"}]}];
- each answer a text, or one assistant message of text.

Every image is a local file relative to the data file, opened and checked as SFT's image rows are (image_rows.py,
images.py); a pair without an image, an empty answer or two equal answers is refused naming the file and row. A pair
whose prompt (its image tokens expanded by the processor) fills data.max_length is left out and named: TRL cuts each
row at max_length keeping its start, so nothing of its answers would train, and an image's tokens cut would not
match its pixels; none left is an error.

Batches are TRL's (methods/pairs.py ImagePairs), given each row's images decoded as hftrain decodes every image
(images.open_rgb: a 16-bit grey image scaled, transparency on white) and its messages as written (`clean`)."""

from __future__ import annotations

import datasets

from ..config import DataSection, DataSource
from ..data.left_out import none_left, say_left_out
from ..data.source_loop import PLACE, read_sources
from ..data.sources import column_map, read_rows
from ..errors import DataError
from .image_rows import base_folder, canonical_image_row
from .image_sources import processor_read_problems
from .images import open_rgb

ANSWERS = ("chosen", "rejected")


def _answer(value, what: str, roles: dict[str, str]) -> list[dict]:
    """An answer as one assistant message of text parts (TRL's vision collator renders it after the prompt)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and isinstance(
            value[0].get("content"), str) and roles.get(value[0].get("role"), value[0].get("role")) == "assistant":
        value = value[0]["content"]
    if not isinstance(value, str):
        raise DataError(f"{what} must be the assistant's answer: a text, or one message {{\"role\": \"assistant\", "
                        f"\"content\": text}} (got {str(value)[:80]})")
    if not value.strip():
        raise DataError(f"{what} is empty: a pair needs an answer on both sides; fix or remove the row")
    return [{"role": "assistant", "content": [{"type": "text", "text": value}]}]


def image_pair(row: dict, at: str, base: str, roles: dict[str, str]) -> dict:
    """{prompt: canonical messages with image parts, chosen, rejected, images: their paths} of one row, every image
    checked; a DataError names `at` (the file and row) and the fix."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{at}: a pair with images needs a 'prompt' column: the user's turn(s) with their "
                        "images (content parts, or <image> markers and an images column)")
    canon = canonical_image_row({"messages": prompt, "images": row.get("images")}, at, base, "messages", roles)
    if canon["messages"][-1]["role"] != "user":
        raise DataError(f"{at}: the prompt must end with the user's turn, which both answers reply to")
    if not canon["images"]:
        raise DataError(f"{at}: the pair has no image; an image-text-to-text recipe trains on pairs with images "
                        "(text pairs train with a text model's recipe)")
    pair = {side: _answer(row.get(side), f"{at}: {side}", roles) for side in ANSWERS}
    if pair["chosen"] == pair["rejected"]:
        raise DataError(f"{at}: chosen equals rejected: the pair prefers neither; fix or remove the row")
    return {"prompt": canon["messages"], **pair, "images": canon["images"]}


def prompt_tokens(processor, pair: dict) -> int:
    """The prompt's length as the model reads it: rendered with its generation prompt, each image's tokens expanded
    by the processor."""
    text = processor.apply_chat_template(clean(pair["prompt"]), add_generation_prompt=True, tokenize=False)
    images = [open_rgb(path) for path in pair["images"]]
    return len(processor(images=images, text=[text], add_special_tokens=False)["input_ids"][0])


def _source_pairs(src: DataSource, key: str) -> datasets.Dataset:
    rows = read_rows(src, key)
    rename, base = column_map(rows, src, key), base_folder(src.path)
    pairs, places = [], []
    for where, row in rows.iterate():
        pairs.append(image_pair({rename.get(k, k): v for k, v in row.items()}, f"{key} ({where})", base, src.roles))
        places.append(where)
    if not pairs:
        raise DataError(f"{key}.path: {src.path} has no pairs")
    return datasets.Dataset.from_list(pairs).add_column(PLACE, places)


def read_image_pairs(cfg: DataSection, processor, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(training pairs mixed by weight, held-out pairs or None): every source read and checked, held out as every
    method holds out (data/source_loop.py), then measured (the module docstring)."""

    def finish(ds: datasets.Dataset, key: str, src: DataSource) -> datasets.Dataset:
        lengths = [prompt_tokens(processor, ds[i]) for i in range(len(ds))]
        kept = [i for i, n in enumerate(lengths) if n < cfg.max_length]
        places, too_long = ds[PLACE], [i for i, n in enumerate(lengths) if n >= cfg.max_length]
        if not kept and len(ds):
            raise none_left(key, src.path, len(ds), "pairs",
                            f"has a prompt of data.max_length={cfg.max_length} tokens or more (its images' tokens "
                            f"included), so none of their answers would train (the shortest has {min(lengths)})",
                            f"raise data.max_length above {min(lengths)}")
        say_left_out(key, src.path, [places[i] for i in too_long], len(ds), "pairs",
                     f"their prompt alone (its images' tokens included) fills data.max_length={cfg.max_length} tokens")
        return ds.select(kept).remove_columns(PLACE)

    split = read_sources(cfg, seed, lambda src, key, group: _source_pairs(src, key), finish)
    return split.train, (datasets.concatenate_datasets(split.held) if split.held else None)


def clean(messages: list[dict]) -> list[dict]:
    """Messages as written, without the empty fields a dataset's columns give every part (an image part's text)."""
    return [{**m, "content": [{k: v for k, v in part.items() if v is not None} for part in m["content"]]}
            for m in messages]


def decoded(row: dict) -> dict:
    """A pair as TRL's vision collator takes it: its messages as written, its images decoded (images.open_rgb); a row
    without its images column is refused (the Trainer drops columns with remove_unused_columns)."""
    if "images" not in row:
        raise DataError("the image pairs reached the collator without their images column: "
                        "training.remove_unused_columns: true drops it; remove that setting")
    return {"prompt": clean(row["prompt"]), "chosen": clean(row["chosen"]), "rejected": clean(row["rejected"]),
            "images": [open_rgb(path) for path in row["images"]]}


def image_pair_problems(data: DataSection) -> list[tuple[str, str]]:
    """(key, message) of the data keys image pairs cannot honour: the processor's template renders them, in TRL's
    collator, which takes no template arguments; images are read in one process."""
    out = processor_read_problems(data)
    if data.chat_template_kwargs:
        out.append(("data.chat_template_kwargs", "image pairs are rendered by TRL's vision collator, which passes no "
                    "template arguments: remove it"))
    return out
