"""Images as the Hub's datasets hold them (issue 66, item 3): an Image feature column of a Parquet file or a saved Arrow
dataset, its images in the rows as bytes, with the Hub's layout (an images column, image parts without a file of
their own) gives the examples the same rows with image files give; each held image is kept once as a file by its
content; a damaged one is a DataError naming the row."""

from __future__ import annotations

import hashlib
import os

import datasets
import pytest

from hftrain.errors import DataError
from hftrain.vision.images import image_store

from .test_vision import _examples, _write, image_dir, part_rows, vlm_dirs  # noqa: F401


def hub_rows(folder) -> list[dict]:
    """part_rows() as the Hub writes them: each row's images in an images column (the files' bytes), image parts
    without a file."""
    out = []
    for row in part_rows():
        images, messages = [], []
        for m in row["messages"]:
            parts = []
            for p in m["content"]:
                if p["type"] == "image":
                    images.append({"bytes": (folder / p["image"]).read_bytes(), "path": None})
                    parts.append({"type": "image", "text": None})
                else:
                    parts.append({"type": "text", "text": p["text"]})
            messages.append({"role": m["role"], "content": parts})
        out.append({"images": images, "messages": messages})
    return out


def _dataset(folder) -> datasets.Dataset:
    features = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}]})
    return datasets.Dataset.from_list(hub_rows(folder), features=features)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
@pytest.mark.parametrize("stored", ["parquet", "arrow"])
def test_an_image_column_gives_the_examples_of_image_files(vlm_dirs, image_dir, family, stored):  # noqa: F811
    _, from_files = _examples(vlm_dirs[family], family, _write(image_dir / "parts.jsonl", part_rows()))
    ds = _dataset(image_dir)
    if stored == "parquet":
        ds.to_parquet(str(image_dir / "rows.parquet"))
        path = str(image_dir / "rows.parquet")
    else:
        ds.save_to_disk(str(image_dir / "saved"))
        path = str(image_dir / "saved")
    os.remove(image_dir / "red.png")  # the rows hold their images: the files are not read
    _, from_column = _examples(vlm_dirs[family], family, path)
    assert len(from_column.train) == len(from_files.train) == 2
    for a, b in zip(from_column.train, from_files.train):
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
        kept = [open(p, "rb").read() for p in a["images"]]  # kept as the bytes the rows hold, named by them
        assert all(os.path.dirname(p) == image_store() for p in a["images"])
        assert [hashlib.sha256(k).hexdigest() for k in kept] == [os.path.basename(p) for p in a["images"]]
    stamps = {p: os.stat(p).st_mtime_ns for e in from_column.train for p in e["images"]}
    _examples(vlm_dirs[family], family, path)  # read again: found, not written again
    assert {p: os.stat(p).st_mtime_ns for p in stamps} == stamps


def test_a_damaged_image_in_the_rows_is_a_data_error_naming_the_row(vlm_dirs, image_dir):  # noqa: F811
    rows = hub_rows(image_dir)  # undecoded, as a Parquet file holds them: {"bytes", "path"}
    rows[1]["images"][0]["bytes"] = rows[1]["images"][0]["bytes"][:40]  # cut short
    features = datasets.Features({"images": datasets.Sequence(datasets.Image(decode=False)),
                                  "messages": _dataset(image_dir).features["messages"]})
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(image_dir / "cut.parquet"))
    with pytest.raises(DataError, match=r"cut.parquet row 1\), image 0: .* (is damaged or truncated|is not an image)"):
        _examples(vlm_dirs["qwen2_5_vl"], "qwen2_5_vl", str(image_dir / "cut.parquet"))
