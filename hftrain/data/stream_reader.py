"""The raw rows of one streamed source for this process, from a position (stream.py's module docstring): JSON-lines
files in byte blocks shuffled every pass and dealt to the processes, .json arrays element by element, and every
other source through datasets' streaming loader split between processes."""

from __future__ import annotations

import os
from typing import Iterator

import datasets
import numpy as np

from ..config import DataSource
from ..errors import DataError
from .jsonrows import ROW_LIMIT, WHITESPACE, array_rows, is_array_file, too_large
from .sources import FILE_BUILDERS

BLOCKS_PER_PROCESS = 16  # a JSON-lines file is cut into at least this many blocks per process
MAX_BLOCK = 1 << 20


def line_number(path: str, offset: int) -> int:
    """1-based line of the byte at `offset` (a message's row name; read up to it)."""
    n, done = 1, 0
    with open(path, "rb") as fh:
        while done < offset:
            chunk = fh.read(min(1 << 20, offset - done))
            if not chunk:
                break
            n += chunk.count(b"\n")
            done += len(chunk)
    return n


class JsonLines:
    """A JSON-lines (or .json array) source's raw rows for one process."""

    def __init__(self, files: list[str], key: str, rank_: int, world: int, seed: int):
        self.files, self.key, self.rank, self.world, self.seed = files, key, rank_, world, seed
        self.arrays = [is_array_file(f) for f in files]
        self.blocks: list[tuple[int, int, int]] = []  # (file, start, end); arrays: one block (file, -1, -1)
        for i, f in enumerate(files):
            if self.arrays[i]:
                self.blocks.append((i, -1, -1))
                continue
            size = os.path.getsize(f)
            n = max(BLOCKS_PER_PROCESS * world, -(-size // MAX_BLOCK))
            step = max(-(-size // n), 1)
            self.blocks += [(i, s, min(s + step, size)) for s in range(0, size, step)]

    def order(self, pass_no: int) -> list[tuple[int, int, int]]:
        """This process's blocks of a pass: the pass's shuffled order dealt to the processes in turn (arrays: every
        process reads them, keeping its elements)."""
        perm = np.random.default_rng([self.seed, pass_no, 7]).permutation(len(self.blocks))
        lines = [self.blocks[k] for k in perm if self.blocks[k][1] >= 0]
        return lines[self.rank::self.world] + [b for b in self.blocks if b[1] < 0]

    def name(self, file: int, offset: int) -> str:
        path = self.files[file]
        return f"{path} index {offset}" if self.arrays[file] else f"{path}:{line_number(path, offset)}"

    def rows(self, pass_no: int, start) -> Iterator[tuple[object, tuple[int, int], str]]:
        """(position of the row, (file, offset or index), its JSON text) from `start` ((block, offset) or None)."""
        blocks = self.order(pass_no)
        k0, at = start if start is not None else (0, None)
        for k in range(k0, len(blocks)):
            i, lo, hi = blocks[k]
            skip = at if k == k0 and at is not None else 0
            if lo < 0:  # a .json array: element `offset` is the index
                for index, text, _ in array_rows(self.files[i], self.key):
                    if index >= skip and index % self.world == self.rank:
                        yield (k, index), (i, index), text.encode()
                continue
            with open(self.files[i], "rb") as fh:
                if k == k0 and at is not None:
                    fh.seek(at)
                elif lo > 0:
                    fh.seek(lo - 1)
                    if fh.read(1) != b"\n":  # the line that started in the block before belongs to it
                        while (part := fh.readline(ROW_LIMIT + 1)) and not part.endswith(b"\n"):
                            pass  # read in bounded pieces: that block refuses a line over the limit
                while (pos := fh.tell()) < hi:
                    raw = fh.readline(ROW_LIMIT + 1)
                    if not raw:
                        break
                    if len(raw) > ROW_LIMIT and not raw.endswith(b"\n"):
                        raise too_large(self.name(i, pos), self.key, "line")
                    if pos == 0:
                        raw = raw.removeprefix(b"\xef\xbb\xbf")
                    if raw.strip(WHITESPACE):
                        yield (k, pos), (i, pos), raw.rstrip(b"\r\n")

    def end(self, pass_no: int, last) -> object:
        """The position after the row at `last` (the next window's start)."""
        k, at = last
        i, lo, hi = self.order(pass_no)[k]
        if lo < 0:
            return (k, at + 1)
        with open(self.files[i], "rb") as fh:
            fh.seek(at)
            fh.readline(ROW_LIMIT + 1)
            return (k, fh.tell()) if fh.tell() < hi else (k + 1, None)


class StreamedDataset:
    """Any other source through datasets' streaming loader, split between processes."""

    def __init__(self, src: DataSource, how: str, files: list[str], key: str, rank_: int, world: int):
        path = os.path.expanduser(src.path)
        try:
            if how == "saved":
                ds = datasets.load_from_disk(path)
                ds = ds[src.split] if isinstance(ds, datasets.DatasetDict) else ds
                ds = ds.to_iterable_dataset(num_shards=max(world, 1) * 4)
            elif how == "files":
                ds = datasets.load_dataset(FILE_BUILDERS[os.path.splitext(files[0])[1].lower()], data_files=files,
                                           split="train", streaming=True)
            else:
                ds = datasets.load_dataset(path, name=src.name, split=src.split, streaming=True)
        except Exception as e:  # datasets raises many types; say which source failed and why
            raise DataError(f"{key}.path: cannot stream {path}: {type(e).__name__}: {e}") from e
        from datasets.distributed import split_dataset_by_node

        self.ds = split_dataset_by_node(ds, rank=rank_, world_size=world) if world > 1 else ds
        self.path, self.key, self.rank = path, key, rank_
        self.initial = self.ds.state_dict()  # the beginning (a loaded state stays until another is loaded)

    def rows(self, pass_no: int, start) -> Iterator[tuple[object, tuple[int, int], dict]]:
        self.ds.load_state_dict(start if start is not None else self.initial)
        it = iter(self.ds)
        n = 0
        while True:
            state = self.ds.state_dict()
            try:
                row = next(it)
            except StopIteration:
                return
            yield state, (0, n), row
            n += 1

    def name(self, file: int, offset: int) -> str:
        return f"{self.path} (row {offset} of those process {self.rank} streams)"

    def end(self, pass_no: int, last) -> object:
        return self.ds.state_dict()
