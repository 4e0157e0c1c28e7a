"""A data source's keys on an image recipe, as the text sources read them where image rows have the same thing:
`format` (messages or sharegpt, or auto: detected from the columns), `columns` (renaming the messages,
conversations, images and system columns), `roles` (the data's role names, ShareGPT's `from` values among them),
`weight` (sources mixed by data.mix), `split` and `name` (data.read_rows). The layout and the column renaming are
the text side's own (data/layouts.py source_layout). What image rows have no place for is refused by `hftrain check`
and the run before any row is read (image_data_problems, called by launch/model_checks.py): a text-only layout, a
column image rows never read (a message's reasoning, tools, prompt/completion), a role mapped to a tool turn,
data.chat_template (the processor's template renders image rows), data.completion_only_loss: false and data.num_proc."""

from __future__ import annotations

from ..config import DataSection, DataSource
from ..constants import ROLE_TARGETS
from ..data.layouts import source_layout
from ..data.sources import Rows
from ..errors import DataError

IMAGE_LAYOUTS = ("messages", "sharegpt")
IMAGE_COLUMNS = ("messages", "conversations", "images", "system")
IMAGE_ROLES = ("system", "user", "assistant")


def _source_problems(src: DataSource, key: str) -> list[tuple[str, str]]:
    out = []
    if isinstance(src.format, str) and src.format not in ("auto", *IMAGE_LAYOUTS):
        out.append((f"{key}.format", f"image rows are conversations: messages or sharegpt (or auto, detected from "
                    f"the columns), not {src.format}; write the rows as conversations with their images"))
    for ours in src.columns if isinstance(src.columns, dict) else ():
        if ours not in IMAGE_COLUMNS:
            out.append((f"{key}.columns.{ours}", f"image rows read only the columns {', '.join(IMAGE_COLUMNS)} (a "
                        "message's reasoning, tools, prompt/completion: not for image rows yet); remove the entry"))
    for theirs, ours in src.roles.items() if isinstance(src.roles, dict) else ():
        if ours in ROLE_TARGETS and ours not in IMAGE_ROLES:
            out.append((f"{key}.roles.{theirs}", f"image rows have no tool turns ('{ours}'): map {theirs} to "
                        f"{', '.join(IMAGE_ROLES)}, or remove the entry"))
    return out


def processor_read_problems(data: DataSection) -> list[tuple[str, str]]:
    """(key, message) of the data keys no image recipe honours, whatever its rows (examples, pairs, prompts): the
    processor's template renders them, read in one process."""
    out = []
    if data.chat_template is not None:  # the labels and the processor's ids come from one template: the processor's
        out.append(("data.chat_template", "an image-text-to-text recipe renders with its processor's chat template "
                    "(the model folder's chat_template.jinja or chat_template.json); put the template there, or "
                    "remove this key"))
    if data.num_proc is not None:  # image rows are read and checked in one process (their images opened there)
        out.append(("data.num_proc", "image rows are read and their images checked in one process per machine: "
                    "remove it"))
    return out


def image_data_problems(data: DataSection) -> list[tuple[str, str]]:
    """(key, message) of every key of the data section, data.sources and data.eval_sources that image rows cannot
    honour."""
    out = processor_read_problems(data)
    if data.completion_only_loss is False:  # image rows are conversations: assistant_only_loss says what trains
        out.append(("data.completion_only_loss", "applies to prompt/completion rows; image rows are conversations, "
                    "whose trained tokens data.assistant_only_loss sets: remove it"))
    for group in ("sources", "eval_sources"):
        sources = getattr(data, group)
        for i, src in enumerate(sources if isinstance(sources, list) else []):
            if isinstance(src, DataSource):
                out += _source_problems(src, f"data.{group}.{i}")
    return out


def image_layout(rows: Rows, src: DataSource, key: str) -> tuple[str, dict[str, str]]:
    """(the source's layout, messages or sharegpt; the rename map of its `columns:`), as the text sources find them;
    a source of a text-only layout is a DataError."""
    fmt, rename, _ = source_layout(rows, src, key)
    if fmt not in IMAGE_LAYOUTS:
        raise DataError(f"{key}: {src.path} is {fmt} rows; image rows are conversations: a messages column (or "
                        f"ShareGPT's conversations) with the images in content parts or an images column; map "
                        f"yours with {key}.columns")
    return fmt, rename
