"""Prompts with images for online RL on an image-text-to-text model: image rows in SFT's layouts (image_rows.py:
content parts naming their files, an images column with `<image>` markers, ShareGPT), each the prompt its policy
answers (its turns before the last assistant turn) and the reference answer (that turn's text; none where the row
ends on a user turn), read and checked before any model loads; a row without an image, or with one in its answer, is
refused naming the file and row.

A prompt is measured as the model reads it (rendered with its generation prompt, each image's tokens expanded by the
processor: image_pairs.prompt_tokens); one longer than data.max_length less the completion's room is an error naming
its row, or left out and named with data.truncation: drop.

The trainer reads the rows' images decoded: the training rows decode their image files when read (`decoded_rows`,
images.open_rgb: a 16-bit grey image scaled, transparency on white), never raw; held-out rows are answered from their
files as SFT's are (image_answers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets

from ..config import DataSection, DataSource
from ..data.left_out import say_left_out
from ..data.messages import content_text
from ..data.source_loop import read_sources
from ..data.sources import read_rows
from ..errors import DataError
from .image_pairs import clean, prompt_tokens
from .image_rows import base_folder, canonical_image_row
from .image_sources import image_layout
from .images import open_rgb

PROMPT, IMAGES, REFERENCE = "prompt", "images", "reference"


@dataclass
class ImagePromptData:
    train: Any  # datasets.Dataset of prompt (messages with image parts), images (decoded when read), reference
    eval: None  # no evaluation dataset: the policy is judged by exact match on eval_examples
    eval_examples: list[dict]  # held-out {messages, images, reference} for evaluate.exact_match
    conversational: bool = True
    processor: Any = None  # the trainer's processing class, saved beside the model


def image_prompt(canon: dict, at: str, needs_reference: str | None) -> dict:
    """{prompt, images, reference} of one canonical image row (image_rows.canonical_image_row)."""
    msgs = canon["messages"]
    answered = msgs[-1]["role"] == "assistant"
    if answered and any(part["type"] == "image" for part in msgs[-1]["content"]):
        raise DataError(f"{at}: the answer (the last assistant turn) holds an image; images belong to the prompt")
    prompt = msgs[:-1] if answered else msgs
    if not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{at}: the conversation has no user turn before the answer: give it the prompt")
    if not canon["images"]:
        raise DataError(f"{at}: the prompt has no image; an image-text-to-text recipe trains on prompts with images "
                        "(text prompts train with a text model's recipe)")
    if needs_reference and not answered:
        raise DataError(f"{at}: has no reference answer (the conversation ends on a user turn), which "
                        f"{needs_reference} compares with; give the row its answer or use other rewards")
    return {PROMPT: prompt, IMAGES: canon["images"], REFERENCE: content_text(msgs[-1]["content"]) if answered else None}


def _source_prompts(src: DataSource, key: str, processor, cfg: DataSection, room: int,
                    needs_reference: str | None) -> datasets.Dataset:
    rows = read_rows(src, key)
    fmt, rename = image_layout(rows, src, key)
    base, out, too_long = base_folder(src.path), [], []
    for where, row in rows.iterate():
        at = f"{key} ({where})"
        canon = canonical_image_row({rename.get(k, k): v for k, v in row.items()}, at, base, fmt, src.roles)
        prompt = image_prompt(canon, at, needs_reference)
        n = prompt_tokens(processor, prompt)
        if n > room:
            if cfg.truncation != "drop":
                raise DataError(f"{at}: the prompt is {n} tokens (its images' included) and data.max_length "
                                f"{cfg.max_length} less the completion's {cfg.max_length - room} leaves {room}: raise "
                                "data.max_length, or set data.truncation: drop to leave such rows out")
            too_long.append(where)
            continue
        out.append(prompt)
    say_left_out(key, src.path, too_long, rows.count, "prompts",
                 f"longer than {room} tokens, their images' included (data.truncation: drop)")
    if not out:
        raise DataError(f"{key}: no prompt of {src.path} is left to train on")
    return datasets.Dataset.from_list(out)


def decoded_rows(batch: dict) -> dict:
    """A dataset transform: each row's image files decoded (images.open_rgb) and its messages as written."""
    return {**batch, PROMPT: [clean(msgs) for msgs in batch[PROMPT]],
            IMAGES: [[open_rgb(path) for path in paths] for paths in batch[IMAGES]]}


def read_image_prompts(cfg: DataSection, processor, completion_room: int, seed: int, exact_match: int = 0,
                       needs_reference: str | None = None) -> ImagePromptData:
    """Every source read and checked, held out as every method holds out (data/source_loop.py), the training rows
    decoding their images when read; `completion_room`: the tokens a completion may take; `exact_match`: the held-out
    examples eval.exact_match answers."""
    room = cfg.max_length - completion_room

    def read(src: DataSource, key: str, group: str) -> datasets.Dataset:
        return _source_prompts(src, key, processor, cfg, room, needs_reference if group == "sources" else None)

    split = read_sources(cfg, seed, read)
    held = [row for part in split.held for row in part]
    examples = [{"messages": clean(r[PROMPT]), IMAGES: r[IMAGES], REFERENCE: r[REFERENCE]}
                for r in held if r[REFERENCE] is not None][:exact_match]
    if exact_match and not examples:
        raise DataError("eval.exact_match: no held-out prompt has a reference answer to compare with; give the "
                        "held-out rows their answers (the last assistant turn)")
    return ImagePromptData(split.train.with_transform(decoded_rows), None, examples, processor=processor)


def preview_image_prompts(cfg: DataSection, processor, completion_room: int, n: int) -> str:
    """`hftrain data` for prompts with images: per source the count, and the first `n` prompts rendered as the policy
    receives them (the processor's chat template and generation prompt, an image as its placeholder), each with its
    images' files, its length in tokens (its images' included) and its reference."""
    lines = []
    room = cfg.max_length - completion_room
    for prefix, sources in (("data.sources", cfg.sources), ("data.eval_sources", cfg.eval_sources)):
        for i, src in enumerate(sources):
            key = f"{prefix}.{i}"
            rows = _source_prompts(src, key, processor, cfg, room, None)
            lines.append(f"{key} ({src.path}): {len(rows)} prompts with images, "
                         f"{sum(r is not None for r in rows[REFERENCE])} with a reference answer")
            for row in rows.select(range(min(n, len(rows)))):
                text = processor.apply_chat_template(clean(row[PROMPT]), add_generation_prompt=True, tokenize=False)
                lines += [f"  --- {prompt_tokens(processor, row)} prompt tokens, images {row[IMAGES]}", text,
                          f"  reference: {row[REFERENCE]!r}"]
    return "\n".join(lines)
