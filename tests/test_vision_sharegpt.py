"""ShareGPT image rows (issue 58, item 1), as LLaMA-Factory and Axolotl write them: `conversations` of {from, value}
turns with <image> markers, an `images` column, an optional `system` column; read into the same canonical rows as
the content-parts layout (hftrain/vision/image_rows.py)."""

from __future__ import annotations

import pytest

from hftrain.errors import DataError

from .test_vision import FAMILIES, _examples, _write, image_dir, part_rows, vlm_dirs  # noqa: F401


def sharegpt_rows(system: str | None = None):
    rows = [{"images": ["red.png"], "conversations": [{"from": "human", "value": "<image>what colour is the square"},
                                                      {"from": "gpt", "value": "red"}]},
            {"images": ["blue.png", "green.png"],
             "conversations": [{"from": "human", "value": "describe the image<image>"},
                               {"from": "gpt", "value": "blue"},
                               {"from": "human", "value": "<image>and this"}, {"from": "gpt", "value": "green"}]}]
    return [dict(r, system=system) for r in rows] if system else rows


@pytest.mark.parametrize("family", FAMILIES)
def test_sharegpt_rows_give_the_content_parts_examples(vlm_dirs, image_dir, family):  # noqa: F811
    _, parts = _examples(vlm_dirs[family], family, _write(image_dir / "parts.jsonl", part_rows()))
    _, shared = _examples(vlm_dirs[family], family, _write(image_dir / "sharegpt.jsonl", sharegpt_rows()))
    assert shared.train[:] == parts.train[:]
    assert shared.train[1]["images"] == [str(image_dir / "blue.png"), str(image_dir / "green.png")]


def test_the_system_column_is_the_first_turn(vlm_dirs, image_dir):  # noqa: F811
    system = "you name colours"
    with_system = [dict(r, messages=[{"role": "system", "content": system}] + r["messages"]) for r in part_rows()]
    _, parts = _examples(vlm_dirs["qwen2_5_vl"], "qwen2_5_vl", _write(image_dir / "parts.jsonl", with_system))
    _, shared = _examples(vlm_dirs["qwen2_5_vl"], "qwen2_5_vl",
                          _write(image_dir / "sharegpt.jsonl", sharegpt_rows(system)))
    assert shared.train[:] == parts.train[:]


@pytest.mark.parametrize("spoil, said", [
    (lambda r: r["conversations"].append({"from": "observation", "value": "{}"}),
     r"sharegpt.jsonl:1\): conversations\[2\] must be \{\"from\": human, gpt or system"),
    (lambda r: r["conversations"][1].pop("value"), r"sharegpt.jsonl:1\): conversations\[1\] must be"),
    (lambda r: r.update(messages=[{"role": "user", "content": "hi"}]),
     r"sharegpt.jsonl:1\): the row has both messages and conversations"),
    (lambda r: r["conversations"][1].update(weight=0),
     r"sharegpt.jsonl:1\): conversations\[1\] has weight: image rows carry a turn's from and value only"),
    (lambda r: r["conversations"][0].update(value="what colour is the square"),
     r"sharegpt.jsonl:1\): the row has 1 images and 0 <image> markers"),
])
def test_a_bad_sharegpt_row_is_named(vlm_dirs, image_dir, spoil, said):  # noqa: F811
    rows = sharegpt_rows()
    spoil(rows[0])
    with pytest.raises(DataError, match=said):
        _examples(vlm_dirs["llava"], "llava", _write(image_dir / "sharegpt.jsonl", rows))
