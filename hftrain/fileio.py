"""Small file helpers: atomic writes (a reader sees the old file or the new one, never half of one), JSON reads."""

from __future__ import annotations

import json
import os


def atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    """A JSON file's object, or {} when the file does not exist."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib  # slow to import: only runs that plot pay for it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen before pyplot loads

    return plt


def save_figure(fig, path: str) -> str:
    """Write a matplotlib figure as PNG atomically and close it."""
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    pyplot().close(fig)
    os.replace(tmp, path)
    return path
