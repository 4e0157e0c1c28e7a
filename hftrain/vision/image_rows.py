"""Image rows in canonical form: a conversation whose content parts hold images, in either layout the Hub's
processors and TRL read, every image a local file relative to the data file, opened and checked (images.py):

- content parts: {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
  {"type": "text", "text": "What colour?"}]}, {"role": "assistant", "content": "red"}]} (an image part may name its
  file under "image" or "path");
- an `images` column and `<image>` markers: {"images": ["red.png"], "messages": [{"role": "user", "content":
  "<image>What colour?"}, ...]}, the i-th marker being the i-th image;
- ShareGPT, as LLaMA-Factory and Axolotl write it: {"conversations": [{"from": "human", "value": "<image>What
  colour?"}, {"from": "gpt", "value": "red"}], "images": ["red.png"]}, roles human, gpt and system (the text
  layouts' ShareGPT names: data/messages.py), a `system` column as the first turn.

An image is a file (its path relative to the data file, or absolute) or held in the row itself as the Hub's datasets
hold it (a datasets Image feature of a Parquet or Arrow source: encoded bytes, or a decoded image), kept as a file by
its content (images.held_image). With an images column, an image part without a file of its own ({"type": "image"},
as TRL's and the Hub's vision sets write it) is the next image of the column.

The canonical row: {"messages": [...], "images": [absolute paths]}, each message's content a list of parts, an image
part {"type": "image"} (the i-th of the row is images[i])."""

from __future__ import annotations

import json
import os

from ..data.messages import SHAREGPT_ROLES
from ..errors import DataError
from .images import check_image, image_path

MARKER = "<image>"
ROLES = ("system", "user", "assistant")


def _marked(text: str, images: list, base: str, what: str, used: list) -> list[dict]:
    """Text with <image> markers as parts: text and image parts in order, the markers' images taken from `images`."""
    parts: list[dict] = []
    pieces = text.split(MARKER)
    for k, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if k < len(pieces) - 1:
            if len(used) == len(images):
                raise DataError(f"{what} has more {MARKER} markers than the row has images ({len(images)})")
            used.append(image_path(images[len(used)], base, f"{what}: images[{len(used)}]"))
            parts.append({"type": "image"})
    return parts


def _parts(content, images: list | None, base: str, what: str, used: list) -> list[dict]:
    if isinstance(content, str):
        return _marked(content, images or [], base, what, used) if images is not None else [
            {"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DataError(f"{what}.content is {type(content).__name__} where text or a list of content parts is expected")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts += _parts(part["text"], images, base, f"{what}.content[{i}]", used) if images is not None else [
                {"type": "text", "text": part["text"]}]
        elif kind == "image" and images is None:
            used.append(image_path(part.get("image", part.get("path")), base, f"{what}.content[{i}].image"))
            parts.append({"type": "image"})
        elif kind == "image" and part.get("image", part.get("path")) is None:  # the Hub's: the next of the column
            if len(used) == len(images):
                raise DataError(f"{what} has more image parts than the row has images ({len(images)})")
            used.append(image_path(images[len(used)], base, f"{what}: images[{len(used)}]"))
            parts.append({"type": "image"})
        else:
            raise DataError(f"{what}.content[{i}] is not a text or image part ({json.dumps(part, default=str)[:80]}): "
                            'use {"type": "text", "text": ...} or {"type": "image", "image": "file.png"}'
                            + (" (with an images column, an image is an <image> marker in the text or an image part "
                               "without a file of its own, {\"type\": \"image\"})" if kind == "image" else ""))
    return parts


def _sharegpt(row: dict, where: str, roles: dict[str, str]) -> list[tuple[str, dict]]:
    """A ShareGPT row's turns as {role, content} messages (its `system` column first), each with its name in the
    row; `roles` (the source's) first, then ShareGPT's names."""
    turns, system = row["conversations"], row.get("system")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: conversations must be a non-empty list of {{from, value}} turns")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: system is {type(system).__name__} where the system prompt's text is expected")
    out = [("system", {"role": "system", "content": system})] if system else []
    for i, turn in enumerate(turns):
        said = turn.get("from") if isinstance(turn, dict) else None
        role = roles.get(said, SHAREGPT_ROLES.get(said, said)) if isinstance(said, str) else None
        if role not in ROLES or "value" not in turn:
            raise DataError(f"{where}: conversations[{i}] must be {{\"from\": human, gpt or system, \"value\": "
                            f"...}} ({json.dumps(turn, default=str)[:80]}); image rows have no tool turns")
        _refuse_dropped_fields(turn, f"{where}: conversations[{i}]", ("from", "value"))
        out.append((f"conversations[{i}]", {"role": role, "content": turn["value"]}))
    return out


def _mapped(m, roles: dict[str, str]):
    """A message with its role mapped by the source's `roles`."""
    said = m.get("role") if isinstance(m, dict) else None
    return dict(m, role=roles[said]) if isinstance(said, str) and said in roles else m


def _turns(row: dict, where: str, fmt: str, roles: dict[str, str]):
    """The row's messages, each with its name in the row, from the column its source's layout names."""
    col, other = ("conversations", "messages") if fmt == "sharegpt" else ("messages", "conversations")
    if row.get(other) is not None:
        raise DataError(f"{where}: the row has both messages and conversations; keep one of them"
                        if row.get(col) is not None else f"{where}: the row has {other} where its source's rows have "
                        f"{col} ({fmt}); put each layout in a source of its own")
    if fmt == "sharegpt":
        return _sharegpt(row, where, roles)
    msgs = row.get("messages")
    return [(f"messages[{i}]", _mapped(m, roles)) for i, m in enumerate(msgs)] if isinstance(msgs, list) else msgs


def _empty(value) -> bool:
    """An empty text or collection: what a column other rows fill holds in a row without it (0 and false are
    values: a turn's weight 0 says something)."""
    return isinstance(value, (str, list, dict)) and len(value) == 0


def _refuse_dropped_fields(message: dict, what: str, kept: tuple[str, str] = ("role", "content")) -> None:
    """A message field image rows do not carry (a reasoning, tool calls) is an error, not dropped: the conversation
    rendered without it would train other text than the row holds. Empty values (a column other rows fill) pass."""
    extra = sorted(k for k, v in message.items() if k not in kept and v is not None and not _empty(v))
    if extra:
        raise DataError(f"{what} has {', '.join(extra)}: image rows carry a turn's {' and '.join(kept)} only (its "
                        f"{extra[0]} would be dropped, not trained); remove the field or put it in the content")


def canonical_image_row(row: dict, where: str, base: str, fmt: str = "messages",
                        roles: dict[str, str] | None = None) -> dict:
    """One row (its columns named as hftrain names them) of a source of layout `fmt` (messages or sharegpt) as a
    canonical conversation with its images' paths, each image checked (a DataError names the row and the image);
    `roles`: the source's role map."""
    msgs = _turns(row, where, fmt, roles or {})
    if row.get("tools") is not None and not _empty(row["tools"]):
        raise DataError(f"{where}: the row has tools; image rows have no tool turns yet, and the tools would not "
                        "reach the template: remove the column")
    images = row.get("images")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} messages (or ShareGPT's "
                        "conversations of {from, value} turns)")
    if images is not None and not isinstance(images, list):
        raise DataError(f"{where}: images must be a list of image paths (relative to the data file) or of images "
                        "(a datasets Image feature)")
    used: list[str] = []
    out = []
    for name, m in msgs:
        what = f"{where}: {name}"
        if not isinstance(m, dict) or m.get("role") not in ROLES or "content" not in m:
            raise DataError(f"{what} must be {{\"role\": one of {', '.join(ROLES)}, \"content\": ...}}")
        _refuse_dropped_fields(m, what)
        out.append({"role": m["role"], "content": _parts(m["content"], images, base, what, used)})
    if images is not None and len(used) != len(images):
        raise DataError(f"{where}: the row has {len(images)} images and {len(used)} {MARKER} markers or image parts; "
                        "give one per image, where the image goes")
    for k, path in enumerate(used):
        check_image(path, f"{where}, image {k}")
    return {"messages": out, "images": used}


def base_folder(path: str) -> str:
    """The folder image paths are relative to: the data file's."""
    return os.path.dirname(os.path.abspath(path))
