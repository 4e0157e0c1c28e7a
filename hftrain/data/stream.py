"""data.streaming: training examples made as training goes, from sources larger than memory or disk.

Each process reads its own share of every source, in passes that never end (training.max_steps ends the run):
JSON-lines files are cut into byte blocks (a block owns the lines that start in it) whose order is shuffled every
pass and dealt to the processes in turn; other sources (parquet, CSV, saved and Hub datasets) are read by
datasets' streaming loader, split between processes by datasets.distributed.split_dataset_by_node, and .json arrays
are read by every process, each keeping every world-th element. Rows are shuffled in windows of
data.shuffle_buffer rows, rendered and tokenised one at a time (rows.py, the pipeline of prepared data; image rows
by vision/image_examples.py, the reader stream_dataset is given), too long
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
from typing import Any, Callable, Iterator, Protocol

import datasets
import numpy as np

from ..config import DataSection, DataSource
from ..distributed import print0, rank, world_size
from ..errors import DataError
from .rows import layout_of, row_examples
from .sources import FILE_BUILDERS, Rows, data_files, read_rows_sample, row_size_problem
from .stream_reader import JsonLines, StreamedDataset
from .stream_identity import identity_changes, source_identity, stream_change_problem

DEFAULT_SHUFFLE_BUFFER = 10_000
EMPTY_PASSES = 64  # passes in a row without a row for this process: the source is too small for the processes
HISTORY = 1 << 14  # positions kept for examples made but not yet trained on (the dataloader reads ahead)
CHECK_ROWS = 1000  # rows of each source `hftrain check` tokenises in streaming mode
DRAW_CHUNK = 4096


class RowFunction(Protocol):
    """What makes a source's examples from its rows: each example's input_ids and labels (and whatever else the
    collator reads, such as an image row's images), with n_tokens (before any cut) and n_trainable."""

    def of_row(self, row: dict, where: str) -> list[dict[str, Any]]: ...


# (first rows of the source, the source, its key, the tokenizer or processor, the data section) -> its row function
RowsReader = Callable[[Rows, DataSource, str, Any, DataSection], RowFunction]
KEPT_OUT = ("n_tokens", "n_trainable")  # counts the stream reads, not the collator


def text_rows(sample: Rows, src: DataSource, key: str, tokenizer, cfg: DataSection) -> RowFunction:
    """The text pipeline's tokenising function (rows.py), its layout found from the source's first rows."""
    return row_examples(layout_of(sample, src, key, tokenizer), tokenizer, cfg)


@dataclass(frozen=True)
class Position:
    """Where a source's next example is: see the module docstring. `start` is a byte offset in the pass's block
    order ((block index, offset)) or datasets' state_dict."""

    pass_no: int = 0
    start: object = None
    window: int = 0
    row: int = 0
    example: int = 0


class SourceStream:
    """One source's examples for this process, endless, with their positions (see the module docstring)."""

    def __init__(self, index: int, src: DataSource, cfg: DataSection, tokenizer, seed: int, rank_: int, world: int,
                 reader: RowsReader = text_rows):
        key = f"data.sources.{index}"
        how, files = data_files(src, key)
        self.json = how == "files" and FILE_BUILDERS[os.path.splitext(files[0])[1].lower()] == "json"
        self.raw = (JsonLines(files, key, rank_, world, seed) if self.json
                    else StreamedDataset(src, how, files, key, rank_, world))
        self.key, self.src, self.cfg, self.seed, self.index, self.rank = key, src, cfg, seed, index, rank_
        self.buffer = cfg.shuffle_buffer or DEFAULT_SHUFFLE_BUFFER
        self.fn: RowFunction | None = None
        self.tokenizer, self.reader = tokenizer, reader

    def setup(self, sample: Rows) -> None:
        """The row function, its layout found from the first rows of the source."""
        self.fn = self.reader(sample, self.src, self.key, self.tokenizer, self.cfg)

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
            for ex in self.fn.of_row(row, placeholder):
                if self.cfg.truncation == "drop" and ex["n_tokens"] > self.cfg.max_length:
                    continue
                if ex["n_trainable"] == 0:
                    if self.cfg.skip_untrainable:
                        continue
                    raise DataError(f"{self.key}: {placeholder}: no trainable token after masking and truncation "
                                    f"to data.max_length={self.cfg.max_length}. Raise data.max_length, fix the row, "
                                    "or set data.skip_untrainable: true to drop such rows")
                out.append({k: v for k, v in ex.items() if k not in KEPT_OUT})
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

    def __init__(self, cfg: DataSection, tokenizer, seed: int, reader: RowsReader = text_rows):
        self.world, self.rank, self.seed = world_size(), rank(), seed
        self.sources = [SourceStream(i, s, cfg, tokenizer, seed, self.rank, self.world, reader)
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
            s.fn.of_row(row, where)
    print0(f"hftrain: streaming: the first {CHECK_ROWS} rows of each source checked; the rest are read as training "
           "goes")


def stream_dataset(cfg: DataSection, tokenizer, seed: int, reader: RowsReader = text_rows) -> datasets.IterableDataset:
    """The training stream as a datasets IterableDataset of one shard per process (accelerate, with
    dispatch_batches off, hands each process its own); `.hftrain_stream` is the TrainStream (its position).
    `reader`: how a source's rows become examples (text rows; vision/image_examples.py's image rows)."""
    stream = TrainStream(cfg, tokenizer, seed, reader)
    check_sample(cfg, tokenizer, stream)
    ds = datasets.IterableDataset.from_generator(stream.generate, gen_kwargs={"shard": list(range(stream.world))})
    ds.hftrain_stream = stream
    return ds
