"""A streamed source's identity, saved with the stream position (data/stream.py): a resume whose sources changed since
(rows appended, deleted or edited: a JSON-lines file's blocks follow its size, and a saved byte offset would point
into other rows) is refused naming the file and what changed, or, as data.on_stream_change says, streams them from
their beginning or continues anyway."""

from __future__ import annotations

import glob
import os

from ..config import DataSection, DataSource
from .sources import data_files, file_identity


def source_identity(src: DataSource, key: str) -> dict:
    """What a resumed stream must find as it was: the source's local files (path, size, modification time and a
    hash of their first and last 64 KiB: sources.file_identity; a saved dataset's Arrow files), or the Hub name."""
    how, files = data_files(src, key)
    if how == "saved":
        path = os.path.expanduser(src.path)
        files = sorted(glob.glob(os.path.join(path, "**", "*.arrow"), recursive=True))
    if how == "hub":
        return {"hub": [src.path, src.name, src.split]}
    return {"files": [file_identity(f) for f in files]}


def identity_changes(saved: list[dict], now: list[dict]) -> list[str]:
    """What differs between the sources a stream position was saved for and the sources now, one line each."""
    if len(saved) != len(now):
        return [f"the run streamed {len(saved)} sources, the recipe now has {len(now)}"]
    out = []
    for i, (a, b) in enumerate(zip(saved, now)):
        if a == b:
            continue
        if "files" not in a or "files" not in b:
            out.append(f"data.sources.{i}: was {a.get('hub') or 'local files'}, now {b.get('hub') or 'local files'}")
            continue
        before = {f[0]: f for f in a["files"]}
        after = {f[0]: f for f in b["files"]}
        for path in sorted(set(before) | set(after)):
            out += [f"data.sources.{i}: {path}: {why}" for why in _file_change(before.get(path), after.get(path))]
    return out


def _file_change(a: list | None, b: list | None) -> list[str]:
    if a is None:
        return ["added since the run streamed"]
    if b is None:
        return ["gone (the run streamed it)"]
    if a[1] != b[1]:
        grew = "rows added" if b[1] > a[1] else "rows removed"
        return [f"{a[1]} bytes when the run streamed it, {b[1]} now ({grew}, or rows edited)"]
    if a[3] != b[3]:
        return ["its bytes changed (rows edited; the same size)"]
    if a[2] != b[2]:
        return ["modified since the run streamed it (the same size and first and last 64 KiB: copied or touched?)"]
    return []


def stream_change_problem(saved: list[dict] | None, cfg: DataSection, checkpoint: str) -> str | None:
    """The refusal of a resume whose sources changed since its stream position was saved (data.on_stream_change:
    refuse), None when they did not, or when the policy accepts it."""
    if saved is None or cfg.on_stream_change != "refuse":
        return None
    changes = identity_changes(saved, [source_identity(s, f"data.sources.{i}") for i, s in enumerate(cfg.sources)])
    if not changes:
        return None
    return (f"the sources changed since {checkpoint} saved its stream position: {'; '.join(changes[:4])}"
            f"{' ...' if len(changes) > 4 else ''}. Resuming at the saved position would train other rows than the "
            "uninterrupted run (a byte offset now points elsewhere). Set data.on_stream_change: restart to stream the "
            "sources from their beginning (rows already trained on may come again), or continue to resume at the saved "
            "position anyway (only when the rows are the same: a copy, a touch), or start anew")
