"""JSON and JSON-lines files read a row at a time, each row checked and kept as its own JSON text.

Parsed here with Python's json rather than by Arrow, which would merge the keys of every row's tool arguments into
one struct (filling the others with nulls) and refuses a column that is text in one row and a list in another
before a row can be named. Every row is bounded: a line (JSONL) or an array element (.json) longer than ROW_LIMIT
is refused after reading ROW_LIMIT bytes of it, never loaded whole; a .json array is split into its elements as
it is read (json.JSONDecoder.raw_decode on a sliding window), not parsed as one document. A UTF-8 byte-order mark
at the start of a file is skipped, as the CSV reader does.
"""

from __future__ import annotations

import codecs
import json
from typing import Iterator

from ..errors import DataError

ROW_LIMIT = 8 << 20  # bytes of one row in any format (an example is cut at data.max_length tokens anyway)
BOM = codecs.BOM_UTF8
CHUNK = 1 << 20
WHITESPACE = b" \t\r\n"


def too_large(where: str, key: str, what: str = "row") -> DataError:
    return DataError(f"{key}.path: {where}: a {what} of more than {ROW_LIMIT >> 20} MiB; hftrain reads rows of up to "
                     "that size (an example is cut at data.max_length tokens): split the document into several rows")


def is_array_file(path: str) -> bool:
    """A .json file whose first non-blank character is '[' holds an array of rows; any other .json is JSON lines."""
    if not path.lower().endswith(".json"):
        return False
    with open(path, "rb") as fh:
        head = fh.read(4096)
    return head.removeprefix(BOM).lstrip().startswith(b"[")


def only_whitespace(path: str) -> bool:
    """Whether a file holds nothing but blanks (and a byte-order mark): read until the first other byte."""
    with open(path, "rb") as fh:
        first = True
        while chunk := fh.read(CHUNK):
            if first:
                chunk, first = chunk.removeprefix(BOM), False
            if chunk.strip(WHITESPACE):
                return False
    return True


def _decode(raw: bytes, path: str, key: str, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + raw.count(b"\n", 0, e.start)
        raise DataError(f"{key}.path: {path}:{at}: not UTF-8 ({e.reason} at byte {e.start}); save the file as "
                        "UTF-8") from None


def _object(text: str, path: str, where: str, key: str, line: int) -> dict:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{key}.path: {path}:{line + e.lineno - 1}: malformed JSON: {e.msg} (column {e.colno})"
                        ) from None
    if not isinstance(item, dict):
        raise DataError(f"{key}: {where}: a row must be a JSON object of named columns, got {type(item).__name__} "
                        f"{json.dumps(item)[:80]}; write each row as {{\"messages\": [...]}}, {{\"text\": ...}}, ...")
    return item


def line_rows(path: str, key: str) -> Iterator[tuple[int, str, dict]]:
    """(line number, the line's text, its object) of each non-blank line of a JSON-lines file."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(iter(lambda: fh.readline(ROW_LIMIT + 1), b""), 1):
            if len(raw) > ROW_LIMIT and not raw.endswith(b"\n"):
                raise too_large(f"{path}:{n}", key, "line")
            if n == 1:
                raw = raw.removeprefix(BOM)
            if not raw.strip(WHITESPACE):
                continue
            text = _decode(raw, path, key, n).rstrip("\r\n")
            yield n, text, _object(text, path, f"{path}:{n}", key, n)


def array_rows(path: str, key: str) -> Iterator[tuple[int, str, dict]]:
    """(index, the element's text, its object) of each element of a .json array, read a window at a time."""
    with open(path, "rb") as fh:
        yield from _ArrayReader(fh, path, key).rows()


class _ArrayReader:
    """A .json array split into its elements on a sliding window of the file: `buf` holds the text read and not yet
    consumed from `pos`; `line` is the line of `pos`, for messages."""

    def __init__(self, fh, path: str, key: str):
        self.fh, self.path, self.key = fh, path, key
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.line, self.eof, self.offset = "", 0, 1, False, 0

    def rows(self) -> Iterator[tuple[int, str, dict]]:
        self.more()
        self.expect("[", "'[' (a .json file holds an array of rows, or one JSON object per line)")
        self.pos += 1
        index = 0
        if self.expect("]{[\"-0123456789tfn", "a row or ']'") == "]":
            self.pos += 1
        else:
            while True:
                yield index, *self.element(index)
                index += 1
                if self.expect(",]", "',' or ']' after a row") == "]":
                    self.pos += 1
                    break
                self.pos += 1
        self.skip_blanks()
        if self.pos < len(self.buf):
            raise DataError(f"{self.key}.path: {self.path}:{self.line}: malformed JSON: text after the closing ']'")

    def element(self, index: int) -> tuple[str, dict]:
        """The next element's text and object; reads on while it may be cut by the window's end."""
        self.skip_blanks()
        while True:
            try:
                item, end = self.decoder.raw_decode(self.buf, self.pos)
                break
            except json.JSONDecodeError as e:
                if self.eof or len(self.buf) - self.pos > ROW_LIMIT:
                    if not self.eof:
                        raise too_large(f"{self.path} index {index}", self.key) from None
                    at = self.line + self.buf.count("\n", self.pos, e.pos)
                    column = e.pos - max(self.buf.rfind("\n", 0, e.pos), -1)
                    raise DataError(f"{self.key}.path: {self.path}:{at}: malformed JSON: {e.msg} (column {column})"
                                    ) from None
                self.more()
        if end - self.pos > ROW_LIMIT:
            raise too_large(f"{self.path} index {index}", self.key)
        text = self.buf[self.pos:end]
        if not isinstance(item, dict):
            _object(text, self.path, f"{self.path} index {index}", self.key, self.line)
        self.line += text.count("\n")
        self.pos = end
        return text, item

    def more(self) -> None:
        raw = self.fh.read(CHUNK)
        if self.offset == 0:
            raw = raw.removeprefix(BOM)
        try:
            text = self.utf8.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            at = self.line + self.buf.count("\n", self.pos) + raw.count(b"\n", 0, e.start)
            raise DataError(f"{self.key}.path: {self.path}:{at}: not UTF-8 ({e.reason}); save the file as UTF-8"
                            ) from None
        self.offset += len(raw)
        self.eof = not raw
        self.buf, self.pos = self.buf[self.pos:] + text, 0

    def skip_blanks(self) -> None:
        while True:
            start = self.pos
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            self.line += self.buf.count("\n", start, self.pos)
            if self.pos < len(self.buf) or self.eof:
                return
            self.more()

    def expect(self, chars: str, what: str) -> str:
        self.skip_blanks()
        if self.pos < len(self.buf) and self.buf[self.pos] in chars:
            return self.buf[self.pos]
        got = repr(self.buf[self.pos]) if self.pos < len(self.buf) else "the end of the file"
        raise DataError(f"{self.key}.path: {self.path}:{self.line}: malformed JSON: expected {what}, got {got}")
