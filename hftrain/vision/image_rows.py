"""Image rows in canonical form: a conversation whose content parts hold images, in either layout the Hub's
processors and TRL read, every image a local file relative to the data file, opened and checked (images.py):

- content parts: {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
  {"type": "text", "text": "What colour?"}]}, {"role": "assistant", "content": "red"}]} (an image part may name its
  file under "image" or "path");
- an `images` column and `<image>` markers: {"images": ["red.png"], "messages": [{"role": "user", "content":
  "<image>What colour?"}, ...]}, the i-th marker being the i-th image.

The canonical row: {"messages": [...], "images": [absolute paths]}, each message's content a list of parts, an image
part {"type": "image"} (the i-th of the row is images[i])."""

from __future__ import annotations

import json
import os

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
        else:
            raise DataError(f"{what}.content[{i}] is not a text or image part ({json.dumps(part, default=str)[:80]}): "
                            'use {"type": "text", "text": ...} or {"type": "image", "image": "file.png"}'
                            + (" (with an images column, images are <image> markers in the text)" if kind == "image"
                               else ""))
    return parts


def canonical_image_row(row: dict, where: str, base: str) -> dict:
    """One row as a canonical conversation with its images' paths, each image checked (a DataError names the row
    and the image)."""
    msgs, images = row.get("messages"), row.get("images")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} messages")
    if images is not None and not isinstance(images, list):
        raise DataError(f"{where}: images must be a list of image paths (relative to the data file)")
    used: list[str] = []
    out = []
    for i, m in enumerate(msgs):
        what = f"{where}: messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES or "content" not in m:
            raise DataError(f"{what} must be {{\"role\": one of {', '.join(ROLES)}, \"content\": ...}}")
        out.append({"role": m["role"], "content": _parts(m["content"], images, base, what, used)})
    if images is not None and len(used) != len(images):
        raise DataError(f"{where}: the row has {len(images)} images and {len(used)} {MARKER} markers; give one marker "
                        "per image, where the image goes")
    for k, path in enumerate(used):
        check_image(path, f"{where}, image {k}")
    return {"messages": out, "images": used}


def base_folder(path: str) -> str:
    """The folder image paths are relative to: the data file's."""
    return os.path.dirname(os.path.abspath(path))
