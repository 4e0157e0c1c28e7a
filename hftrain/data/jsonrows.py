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
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as fh:
        buf, pos, line, eof, offset = "", 0, 1, False, 0

        def more() -> None:
            nonlocal buf, pos, eof, offset
            raw = fh.read(CHUNK)
            if offset == 0:
                raw = raw.removeprefix(BOM)
            try:
                text = utf8.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                at = line + buf.count("\n", pos) + raw.count(b"\n", 0, e.start)
                raise DataError(f"{key}.path: {path}:{at}: not UTF-8 ({e.reason}); save the file as UTF-8") from None
            offset += len(raw)
            eof = not raw
            buf, pos = buf[pos:] + text, 0

        def skip_blanks() -> None:
            nonlocal pos, line
            while True:
                start = pos
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                line += buf.count("\n", start, pos)
                if pos < len(buf) or eof:
                    return
                more()

        def expect(chars: str, what: str) -> str:
            skip_blanks()
            if pos < len(buf) and buf[pos] in chars:
                return buf[pos]
            got = repr(buf[pos]) if pos < len(buf) else "the end of the file"
            raise DataError(f"{key}.path: {path}:{line}: malformed JSON: expected {what}, got {got}")

        more()
        expect("[", "'[' (a .json file holds an array of rows, or one JSON object per line)")
        pos += 1
        index = 0
        if expect("]{[\"-0123456789tfn", "a row or ']'") == "]":
            pos += 1
        else:
            while True:
                skip_blanks()
                while True:  # decode one element; read on while it may be cut by the window's end
                    try:
                        item, end = decoder.raw_decode(buf, pos)
                        break
                    except json.JSONDecodeError as e:
                        if eof or len(buf) - pos > ROW_LIMIT:
                            if not eof:
                                raise too_large(f"{path} index {index}", key) from None
                            at = line + buf.count("\n", pos, e.pos)
                            column = e.pos - max(buf.rfind("\n", 0, e.pos), -1)
                            raise DataError(f"{key}.path: {path}:{at}: malformed JSON: {e.msg} (column {column})"
                                            ) from None
                        more()
                if end - pos > ROW_LIMIT:
                    raise too_large(f"{path} index {index}", key)
                text = buf[pos:end]
                if not isinstance(item, dict):
                    _object(text, path, f"{path} index {index}", key, line)
                line += text.count("\n")
                pos = end
                yield index, text, item
                index += 1
                if expect(",]", "',' or ']' after a row") == "]":
                    pos += 1
                    break
                pos += 1
        skip_blanks()
        if pos < len(buf):
            raise DataError(f"{key}.path: {path}:{line}: malformed JSON: text after the closing ']'")
