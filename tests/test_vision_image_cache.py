"""Image rows in the datasets cache (issue 66, item 3): a second read of a source opens no image and calls no
processor, and gives the same examples; an image edited in place, another processor setting or another data key is
read again; a cache that cannot be written is said and the read goes on."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from hftrain.config import DataSection, DataSource, ModelSection
from hftrain.vision import image_examples, labels
from hftrain.vision.image_datasets import source_examples
from hftrain.vision.processor import processor_of

from .test_vision import _write, vlm_dirs  # noqa: F401


def _rows(folder) -> str:
    rows = []
    for i, (size, colour) in enumerate([((56, 84), "red"), ((112, 56), "blue")]):
        Image.new("RGB", size, colour).save(folder / f"im{i}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": f"im{i}.png"},
                                                               {"type": "text", "text": "what colour is the square"}]},
                                  {"role": "assistant", "content": colour}]})
    return _write(folder / "rows.jsonl", rows)


def _read(model, path, **data_keys):
    data = DataSection(sources=[DataSource(path=path)], **data_keys)
    processor = processor_of(ModelSection(name_or_path=model), data)
    return source_examples(data.sources[0], "data.sources.0", processor, data)[0]


def _no_reading(monkeypatch):
    """Opening an image or calling the processor on a row fails the test from here on."""
    def refuse(*args, **kwargs):
        raise AssertionError("an image was read again")

    monkeypatch.setattr(image_examples, "canonical_image_row", refuse)
    monkeypatch.setattr(labels, "open_rgb", refuse)


def test_a_second_read_opens_no_image_and_gives_the_same_examples(vlm_dirs, tmp_path, monkeypatch, capsys):  # noqa: F811
    path = _rows(tmp_path)
    first = _read(vlm_dirs["qwen2_5_vl"], path)
    _no_reading(monkeypatch)
    capsys.readouterr()
    again = _read(vlm_dirs["qwen2_5_vl"], path)
    assert again == first and len(again) == 2
    assert "2 rows (prepared before: the datasets cache)" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["image edited", "pixel bound", "max_length"])
def test_what_changes_the_examples_reads_them_again(vlm_dirs, tmp_path, change):  # noqa: F811
    path = _rows(tmp_path)
    first = _read(vlm_dirs["qwen2_5_vl"], path)
    keys = {}
    if change == "image edited":  # the same file, larger: more image tokens
        Image.new("RGB", (224, 224), "red").save(tmp_path / "im0.png")
        os.utime(tmp_path / "im0.png", ns=(1, 1))  # even with an old time: the size differs
    elif change == "pixel bound":
        keys = {"image_max_pixels": 28 * 28 * 4}
    else:
        keys = {"max_length": 1000}
    again = _read(vlm_dirs["qwen2_5_vl"], path, **keys)
    if change == "max_length":  # the same examples, read again under their own key
        assert again == first
    else:
        assert len(again[0]["input_ids"]) != len(first[0]["input_ids"])


def test_a_cache_that_cannot_be_written_is_said_and_the_read_goes_on(vlm_dirs, tmp_path, monkeypatch, capsys):  # noqa: F811
    from hftrain.vision import image_cache

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(image_cache, "atomic_write", full)
    examples = _read(vlm_dirs["qwen2_5_vl"], _rows(tmp_path))
    assert len(examples) == 2
    assert "the image rows were not kept in the datasets cache (No space left on device); the next run reads " \
           "them again" in capsys.readouterr().err
