"""Streaming image rows (issue 66, item 5): with data.streaming an image source's rows are read as training goes
(data/stream.py given vision/image_examples.py's row function): each streamed example equals the prepared one of its
row, images as files or as the Hub's Image column; the position after n examples resumes to the same next examples;
a row too long past the rows checked before training is named by its line; `hftrain data` shows the first rows."""

from __future__ import annotations

import json
import os

import pytest

from hftrain.config import DataSection, DataSource
from hftrain.data.stream import TrainStream
from hftrain.errors import DataError
from hftrain.tiny import build_tiny_vision_model
from hftrain.vision.image_datasets import build_image_datasets
from hftrain.vision.image_preview import image_preview
from hftrain.vision.processor import load_processor

from .test_vision import PROCESSORS, WORDS, _write, image_dir, part_rows  # noqa: F401
from .test_vision_hub_rows import _dataset as hub_dataset

FAMILIES = ["qwen2_5_vl", "llava"]


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_stream")
    return {f: load_processor(build_tiny_vision_model(str(root / f), WORDS * 20, f, vocab_size=320), PROCESSORS[f])
            for f in FAMILIES}


def many_rows(n: int) -> list[dict]:
    """part_rows() repeated, each copy's question numbered (every row its own example)."""
    out = []
    for i in range(n):
        row = json.loads(json.dumps(part_rows()[i % 2]))
        row["messages"][0]["content"][-1 if i % 2 == 0 else 0]["text"] += f" {i}"
        out.append(row)
    return out


def as_tuple(example: dict) -> tuple:
    return tuple(example["input_ids"]), tuple(example["labels"]), tuple(example["images"])


def streamed(cfg: DataSection, processor, n: int, seed: int = 0) -> tuple[list[tuple], TrainStream]:
    stream = build_image_datasets(cfg, processor, seed).train.hftrain_stream
    return [as_tuple(e) for e, _ in zip(stream, range(n))], stream


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_of_the_stream_is_the_prepared_examples(processors, image_dir, family):  # noqa: F811
    """One pass over the rows (a window holding them all) gives each row's prepared example once, in a shuffled
    order; the next pass gives them again, in another."""
    path = _write(image_dir / "rows.jsonl", many_rows(12))
    prepared = build_image_datasets(DataSection(sources=[DataSource(path=path)]), processors[family], seed=0).train
    want = sorted(as_tuple(e) for e in prepared)
    cfg = DataSection(sources=[DataSource(path=path)], streaming=True, shuffle_buffer=64)
    got, _ = streamed(cfg, processors[family], 24)
    assert sorted(got[:12]) == want and sorted(got[12:]) == want
    assert got[:12] != got[12:] and [g for g in got[:12]] != [as_tuple(e) for e in prepared]


def test_the_hubs_image_column_streams_as_image_files_do(processors, image_dir):  # noqa: F811
    """A Parquet file of the Hub's layout (an Image column) read by datasets' streaming loader: the examples of the
    same rows with image files, each image kept by its content."""
    files = _write(image_dir / "parts.jsonl", part_rows())
    hub_dataset(image_dir).to_parquet(str(image_dir / "rows.parquet"))
    processor = processors["qwen2_5_vl"]
    from_files, _ = streamed(DataSection(sources=[DataSource(path=files)], streaming=True), processor, 2)
    os.remove(image_dir / "red.png")  # the rows hold their images: the files are not read
    from_column, _ = streamed(DataSection(sources=[DataSource(path=str(image_dir / "rows.parquet"))],
                                          streaming=True), processor, 2)
    assert sorted(e[:2] for e in from_column) == sorted(e[:2] for e in from_files)


def test_the_position_after_n_examples_resumes_to_the_same_next_examples(processors, image_dir):  # noqa: F811
    """A checkpoint's stream position (state_after(n), through JSON as a checkpoint holds it) resumed gives the next
    examples of the uninterrupted stream, within a window and across windows and passes."""
    path = _write(image_dir / "rows.jsonl", many_rows(10))
    cfg = DataSection(sources=[DataSource(path=path)], streaming=True, shuffle_buffer=4)
    first, stream = streamed(cfg, processors["llava"], 25, seed=5)
    for n in (0, 3, 4, 11, 20):
        again = TrainStream(cfg, processors["llava"], seed=5, reader=type(stream.sources[0].fn).of_source)
        for s, checked in zip(again.sources, stream.sources):
            s.fn = checked.fn  # as stream_dataset sets it up (without checking the first rows again)
        again.resume(json.loads(json.dumps(stream.state_after(n))))
        assert [as_tuple(e) for e, _ in zip(again, range(25 - n))] == first[n:], n


def test_a_row_too_long_in_the_stream_is_named_by_its_line_or_dropped(processors, image_dir):  # noqa: F811
    """A row past the first rows checked before training, longer than data.max_length with its image's tokens: the
    error names the file's line and the image's tokens; with data.truncation: drop the stream goes on without it."""
    from hftrain.data import stream as stream_module

    rows = many_rows(8)
    rows[6]["messages"][0]["content"][-1]["text"] += " what colour is the square" * 40
    path = _write(image_dir / "rows.jsonl", rows)
    cfg = DataSection(sources=[DataSource(path=path)], streaming=True, max_length=128)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_module, "CHECK_ROWS", 2)  # the long row is read as training goes
        _, stream = streamed(cfg, processors["qwen2_5_vl"], 0)
        with pytest.raises(DataError, match=rf"data.sources.0 \({path}:7\): \d+ tokens is more than "
                                            r"data.max_length=128, \d+ of them its images' \(red.png: \d+ tokens\)"):
            for _ in zip(stream, range(16)):
                pass
        dropped = DataSection(sources=[DataSource(path=path)], streaming=True, max_length=128, truncation="drop",
                              shuffle_buffer=8)
        got, _ = streamed(dropped, processors["qwen2_5_vl"], 14)
    assert len(set(got)) == 7 and all(len(ids) <= 128 for ids, *_ in got)


def test_the_data_preview_of_a_streamed_image_source_shows_its_first_rows(processors, image_dir):  # noqa: F811
    path = _write(image_dir / "rows.jsonl", many_rows(6))
    out = image_preview(DataSection(sources=[DataSource(path=path)], streaming=True), processors["llava"], 1)
    assert "image rows, the first 6 rows (streaming: never prepared whole) -> 6 examples, 9 images" in out
