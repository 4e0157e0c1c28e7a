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


def atomic_write(path: str, text: str | bytes) -> None:
    tmp = _own_temporary(path)
    with open(tmp, "wb") if isinstance(text, bytes) else open(tmp, "w", encoding="utf-8") as fh:
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


# -- publishing a staged folder (hftrain.checkpoints' checkpoints, artifacts' final model) -----------------------------
def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flush every file and folder under root to disk, so that the rename publishes data, not holes."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath, directory=True)


def publish(staged: str, final: str) -> None:
    """fsync the staged checkpoint and rename it into place (replacing an older save of the same step)."""
    fsync_tree(staged)
    if os.path.lexists(final):  # e.g. a run re-saving step N after resuming from before N
        shutil.rmtree(final)
    os.rename(staged, final)
    _fsync(os.path.dirname(final), directory=True)
    remove_staging_root(os.path.dirname(staged))


def publish_into(staged: str, out: str) -> list[str]:
    """Move every entry of the staged folder into `out` (os.replace: each file is the old one or the new one,
    never half of one). For the final model, whose folder also holds checkpoints and so cannot be swapped whole."""
    fsync_tree(staged)
    names = sorted(os.listdir(staged))
    for name in names:
        dest = os.path.join(out, name)
        if os.path.isdir(dest) and not os.path.islink(dest):
            shutil.rmtree(dest)
        os.replace(os.path.join(staged, name), dest)
    _fsync(out, directory=True)
    os.rmdir(staged)
    remove_staging_root(os.path.dirname(staged))
    return names


def remove_staging_root(root: str) -> None:
    try:
        os.rmdir(root)  # only when empty
    except OSError:
        pass
