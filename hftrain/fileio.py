"""Small file helpers: atomic writes (a reader sees the old file or the new one, never half of one; a failed write
leaves no temporary file), a full disk told apart from other failures, JSON reads."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import secrets
import struct

NEARLY_FULL = 1 << 20  # bytes


def atomic_write(path: str, text: str) -> None:
    tmp = _own_temporary(path)
    with open(tmp, "w", encoding="utf-8") as fh:
        try:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)  # created by the open above
            raise


def _own_temporary(path: str) -> str:
    """A new, empty file beside `path` (`<name>.tmp-<random>`), created here: the only file a failed write removes."""
    while True:  # O_EXCL: never an existing file; mode 0o666 less the umask, as open() would give the file itself
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def free_bytes(path: str) -> int | None:
    """Free space on the device of `path` (or of its nearest existing parent), or None when it cannot be told."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def is_no_space(exc: BaseException, free: int | None) -> bool:
    """A full disk: errno where there is one; torch.save may only say "unexpected pos ...", so also a
    device left with (almost) no free space when the save failed."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(s in str(exc) for s in ("No space left", "StorageFull", "Disk quota exceeded")):
        return True
    return free is not None and free < NEARLY_FULL


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
    tmp = _own_temporary(path)
    try:
        with open(tmp, "wb") as fh:
            try:
                fig.savefig(fh, dpi=90, format="png")
                fh.flush()
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)  # created by the open above
                raise
    finally:
        pyplot().close(fig)
    return path


def safetensors_problem(path: str) -> str | None:
    """A safetensors file is complete when its header parses and its last tensor ends at the end of the file.

    Reads 8 bytes + the JSON header only (the format: u64 little-endian header length, JSON, tensor bytes)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{path}: truncated ({size} bytes, no header)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path}: truncated (header of {n} bytes, file of {size})"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        return f"{path}: unreadable safetensors header ({e})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path}: truncated ({size} bytes, the header describes {8 + n + end})"
    return None
