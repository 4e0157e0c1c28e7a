"""data.streaming: training examples made as training goes, from sources larger than memory or disk.

Each process reads its own share of every source, in passes that never end (training.max_steps ends the run):
JSON-lines files are cut into byte blocks (a block owns the lines that start in it) whose order is shuffled every
pass and dealt to the processes in turn; other sources (parquet, CSV, saved and Hub datasets) are read by
datasets' streaming loader, split between processes by datasets.distributed.split_dataset_by_node, and .json arrays
are read by every process, each keeping every world-th element. Rows are shuffled in windows of
data.shuffle_buffer rows, rendered and tokenised one at a time (rows.py, the pipeline of prepared data), too long
or untrainable examples dropped or refused as in prepared data, and the sources drawn from by weight.

The position is exact and cheap to restore: a source's position is (pass, where its current window began, the
window's number, the row in the window, the example of that row), where a window begins is a byte offset (JSON
lines) or datasets' own state_dict (other sources, unshuffled, so exact), and the draws between sources are a
counter. `TrainStream.state_after(n)` is the position after this process's first n examples; a checkpoint records
it (stream_position.py) and a resumed stream re-reads one window of raw rows and continues where the
uninterrupted one would. datasets' IterableDataset.state_dict was not enough: it drops its shuffle buffer's rows on
resume (its docstring says so), and accelerate's stateful dataloader needs torchdata and the same state_dict.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass
from typing import Iterator

import datasets
import numpy as np

from ..config import DataSection, DataSource
from ..distributed import print0, rank, world_size
from ..errors import DataError
from .jsonrows import ROW_LIMIT, WHITESPACE, array_rows, is_array_file, too_large
from .rows import RowExamples, layout_of, row_examples
from .sources import FILE_BUILDERS, Rows, data_files, read_rows_sample, row_size_problem
from .stream_identity import identity_changes, source_identity, stream_change_problem

DEFAULT_SHUFFLE_BUFFER = 10_000
BLOCKS_PER_PROCESS = 16  # a JSON-lines file is cut into at least this many blocks per process
MAX_BLOCK = 1 << 20
EMPTY_PASSES = 64  # passes in a row without a row for this process: the source is too small for the processes
HISTORY = 1 << 14  # positions kept for examples made but not yet trained on (the dataloader reads ahead)
CHECK_ROWS = 1000  # rows of each source `hftrain check` tokenises in streaming mode
DRAW_CHUNK = 4096


@dataclass(frozen=True)
class Position:
    """Where a source's next example is: see the module docstring. `start` is a byte offset in the pass's block
    order ((block index, offset)) or datasets' state_dict."""

    pass_no: int = 0
    start: object = None
    window: int = 0
    row: int = 0
    example: int = 0


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


class _JsonLines:
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


class _Datasets:
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


class SourceStream:
    """One source's examples for this process, endless, with their positions (see the module docstring)."""

    def __init__(self, index: int, src: DataSource, cfg: DataSection, tokenizer, seed: int, rank_: int, world: int):
        key = f"data.sources.{index}"
        how, files = data_files(src, key)
        self.json = how == "files" and FILE_BUILDERS[os.path.splitext(files[0])[1].lower()] == "json"
        self.raw = (_JsonLines(files, key, rank_, world, seed) if self.json
                    else _Datasets(src, how, files, key, rank_, world))
        self.key, self.src, self.cfg, self.seed, self.index, self.rank = key, src, cfg, seed, index, rank_
        self.buffer = cfg.shuffle_buffer or DEFAULT_SHUFFLE_BUFFER
        self.fn: RowExamples | None = None
        self.tokenizer = tokenizer

    def setup(self, sample: Rows) -> None:
        """The layout (from the first rows of the source) and the tokenising function."""
        layout = layout_of(sample, self.src, self.key, self.tokenizer)
        self.fn = row_examples(layout, self.tokenizer, self.cfg)

    def _row(self, raw, place: tuple[int, int], placeholder: str) -> dict:
        if not self.json:
            row_size_problem(raw, placeholder, self.key)
            return raw
        where = self.raw.name(*place)
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{self.key}.path: {where}: not UTF-8 ({e.reason} at byte {e.start}); save the file as "
                            "UTF-8") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{self.key}.path: {where}: malformed JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{self.key}: {where}: a row must be a JSON object of named columns, got "
                            f"{type(row).__name__}; write each row as {{\"messages\": [...]}}, {{\"text\": ...}}, ...")
        return row

    def _examples(self, raw, place: tuple[int, int]) -> list[dict]:
        """The examples of one raw row that train (too long ones dropped with truncation: drop; untrainable ones
        refused naming the row, or dropped with skip_untrainable). A row's name in the user's numbering needs its
        line number, which costs reading the file up to it: rows are named by a placeholder while they are made,
        and a failing row's message gets its real name."""
        placeholder = f"<{self.key} row at {place[0]}:{place[1]}>"
        try:
            row = self._row(raw, place, placeholder)
            out = []
            for ex in self.fn.examples(self.fn.layout.canonical(row, placeholder), placeholder):
                if self.cfg.truncation == "drop" and ex["n_tokens"] > self.cfg.max_length:
                    continue
                if ex["n_trainable"] == 0:
                    if self.cfg.skip_untrainable:
                        continue
                    raise DataError(f"{self.key}: {placeholder}: no trainable token after masking and truncation "
                                    f"to data.max_length={self.cfg.max_length}. Raise data.max_length, fix the row, "
                                    "or set data.skip_untrainable: true to drop such rows")
                out.append({"input_ids": ex["input_ids"], "labels": ex["labels"]})
            return out
        except DataError as e:
            if placeholder not in str(e):
                raise
            raise DataError(str(e).replace(placeholder, self.raw.name(*place))) from None

    def windows(self, at: Position) -> Iterator[tuple[Position, dict]]:
        """(position after the example, example) from `at`, forever."""
        pass_no, start, window = at.pass_no, at.start, at.window
        first, empty_passes = True, 0
        while True:
            rows = []
            for row in self.raw.rows(pass_no, start):
                rows.append(row)
                if len(rows) == self.buffer:
                    break
            if not rows:
                empty_passes = empty_passes + 1 if window == 0 else 0
                if empty_passes >= EMPTY_PASSES:
                    raise DataError(f"{self.key}: process {self.rank} found no rows of {self.src.path} in "
                                    f"{EMPTY_PASSES} passes: the source has fewer rows than there are processes; add "
                                    "rows or use fewer processes")
                pass_no, start, window = pass_no + 1, None, 0
                continue
            empty_passes = 0
            after = self.raw.end(pass_no, rows[-1][0]) if len(rows) == self.buffer else None
            nxt = (pass_no, after, window + 1) if after is not None else (pass_no + 1, None, 0)
            order = np.random.default_rng([self.seed, self.index, self.rank, pass_no, window]).permutation(len(rows))
            j0, s0 = (at.row, at.example) if first else (0, 0)
            first = False
            for j in range(j0, len(rows)):
                _, place, raw = rows[order[j]]
                exs = self._examples(raw, place)
                for s in range(s0 if j == j0 else 0, len(exs)):
                    if s + 1 < len(exs):
                        yield Position(pass_no, start, window, j, s + 1), exs[s]
                    elif j + 1 < len(rows):
                        yield Position(pass_no, start, window, j + 1, 0), exs[s]
                    else:
                        yield Position(nxt[0], nxt[1], nxt[2], 0, 0), exs[s]
            pass_no, start, window = nxt


class TrainStream:
    """This process's training examples: the sources' streams drawn from by weight (draw n's source is a function
    of the seed, the process and n), and the position after each example made (`state_after`)."""

    def __init__(self, cfg: DataSection, tokenizer, seed: int):
        self.world, self.rank, self.seed = world_size(), rank(), seed
        self.sources = [SourceStream(i, s, cfg, tokenizer, seed, self.rank, self.world)
                        for i, s in enumerate(cfg.sources)]
        w = np.array([s.weight for s in cfg.sources], dtype=np.float64)
        self.p = w / w.sum()
        self.start: dict | None = None  # set by a resume, read when iteration begins
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.cfg = cfg
        # the sources as this stream cut them into blocks (a JSON-lines file's blocks follow its size)
        self.identity = [source_identity(s, f"data.sources.{i}") for i, s in enumerate(cfg.sources)]

    def state(self, made: int, draws: int, positions: list[Position]) -> dict:
        return {"examples": made, "draws": draws, "world_size": self.world, "rank": self.rank, "seed": self.seed,
                "positions": [vars(p) for p in positions], "sources": self.identity}

    def state_after(self, n: int) -> dict:
        """The position after this process's first n examples (made since the run or the resume began)."""
        for made, state in reversed(self.history):
            if made == n:
                return state
        if n == 0 and self.start is None:
            return self.state(0, 0, [Position() for _ in self.sources])
        raise RuntimeError(f"the stream's position after {n} examples is no longer known (kept: "
                           f"{[m for m, _ in list(self.history)[:1] + list(self.history)[-1:]]})")

    def resume(self, state: dict) -> None:
        if (state["world_size"] != self.world or state["rank"] != self.rank
                or len(state["positions"]) != len(self.sources)):
            raise DataError(f"the checkpoint's stream position was written by process {state['rank']} of "
                            f"{state['world_size']} over {len(state['positions'])} sources; this is process {self.rank}"
                            f" of {self.world} over {len(self.sources)}: resume a streaming run with the same "
                            "processes and sources")
        changes = identity_changes(state["sources"], self.identity) if "sources" in state else []
        policy = self.cfg.on_stream_change
        if changes and policy == "refuse":
            raise DataError(stream_change_problem(state["sources"], self.cfg, "the checkpoint"))
        if changes and policy == "restart":
            print0(f"hftrain: the sources changed since the checkpoint ({'; '.join(changes[:2])}): streaming them "
                   "from their beginning (data.on_stream_change: restart)")
            state = self.state(state["examples"], 0, [Position() for _ in self.sources])
        elif changes:
            print0(f"hftrain: the sources changed since the checkpoint ({'; '.join(changes[:2])}): resuming at the "
                   "saved position anyway (data.on_stream_change: continue)")
        if "sources" not in state:
            print0("hftrain: the checkpoint's stream position was saved without its sources' identity (an older "
                   "hftrain): whether the sources changed since cannot be checked")
        self.start = state

    def __iter__(self) -> Iterator[dict]:
        start = self.start
        made = start["examples"] if start else 0
        draws = start["draws"] if start else 0
        positions = [Position(**p) for p in start["positions"]] if start else [Position() for _ in self.sources]
        streams = [s.windows(p) for s, p in zip(self.sources, positions)]
        self.history.clear()
        self.history.append((made, self.state(made, draws, positions)))
        choices = np.array([], dtype=np.int64)
        while True:
            if draws % DRAW_CHUNK == 0 or len(choices) == 0:
                chunk = np.random.default_rng([self.seed, self.rank, 3, draws // DRAW_CHUNK])
                choices = chunk.choice(len(self.sources), size=DRAW_CHUNK, p=self.p)
            i = int(choices[draws % DRAW_CHUNK])
            positions[i], example = next(streams[i])
            draws += 1
            made += 1
            self.history.append((made, self.state(made, draws, positions)))
            yield example

    def generate(self, shard: list[int]):
        """datasets' generator: accelerate gives each process the shard of its rank (see stream_dataset)."""
        if shard != [self.rank]:
            raise RuntimeError(f"process {self.rank} was handed the stream shard {shard}")
        yield from self


def check_sample(cfg: DataSection, tokenizer, stream: TrainStream) -> None:
    """The layout of every source from its first rows, and those rows tokenised (errors name the file and row);
    says what it sampled."""
    for s in stream.sources:
        sample = read_rows_sample(s.src, s.key, CHECK_ROWS)
        s.setup(sample)
        for where, row in sample.iterate():
            s.fn.examples(s.fn.layout.canonical(row, where), where)
    print0(f"hftrain: streaming: the first {CHECK_ROWS} rows of each source checked; the rest are read as training "
           "goes")


def stream_dataset(cfg: DataSection, tokenizer, seed: int) -> datasets.IterableDataset:
    """The training stream as a datasets IterableDataset of one shard per process (accelerate, with
    dispatch_batches off, hands each process its own); `.hftrain_stream` is the TrainStream (its position)."""
    stream = TrainStream(cfg, tokenizer, seed)
    check_sample(cfg, tokenizer, stream)
    ds = datasets.IterableDataset.from_generator(stream.generate, gen_kwargs={"shard": list(range(stream.world))})
    ds.hftrain_stream = stream
    return ds
