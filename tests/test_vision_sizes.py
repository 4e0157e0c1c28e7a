"""Image size under the recipe's control (issue 66, item 2): data.image_min_pixels / image_max_pixels are the family's
own resize bounds where its image processor has them (Qwen-VL), refused by name where the family sizes every image
itself; a row too long names each image's tokens and the fix."""

from __future__ import annotations

import pytest
from PIL import Image

from hftrain.config import DataSection, DataSource, ModelSection
from hftrain.errors import DataError
from hftrain.vision.families import processor_class
from hftrain.vision.image_datasets import source_examples
from hftrain.vision.labels import image_tokens_in
from hftrain.vision.processor import load_processor, processor_of

from .test_vision import _write, refusals_of_check_and_run, vlm_dirs  # noqa: F401

QWEN = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"]


def _rows(folder, sizes) -> str:
    rows = []
    for i, size in enumerate(sizes):
        Image.new("RGB", size, "red").save(folder / f"im{i}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": f"im{i}.png"},
                                                               {"type": "text", "text": "what colour is the square"}]},
                                  {"role": "assistant", "content": "red"}]})
    return _write(folder / "rows.jsonl", rows)


def _tokens_per_image(folder, path, **data_keys) -> list[int]:
    data = DataSection(sources=[DataSource(path=path)], **data_keys)
    processor = processor_of(ModelSection(name_or_path=folder), data)
    examples, _ = source_examples(data.sources[0], "data.sources.0", processor, data)  # as the run reads them
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return [tokens for e in examples for _, tokens in image_tokens_in(e, image_id)], processor


@pytest.mark.parametrize("family", QWEN)
def test_pixel_bounds_set_each_images_tokens_and_are_saved_with_the_processor(vlm_dirs, tmp_path, family):  # noqa: F811
    patch = 16 if family.startswith("qwen3_vl") else 14
    token = (2 * patch) ** 2  # pixels per token: patches merged 2 x 2
    path = _rows(tmp_path, [(20 * patch, 20 * patch), (2 * patch, 2 * patch)])  # 100 tokens and 1, unbounded
    default, _ = _tokens_per_image(vlm_dirs[family], path)
    assert default == [64, 4]  # the tiny processor's own bounds: 4 to 64 tokens
    bounded, processor = _tokens_per_image(vlm_dirs[family], path, image_min_pixels=9 * token,
                                           image_max_pixels=16 * token)
    assert bounded == [16, 9]
    processor.save_pretrained(tmp_path / "saved")  # as the run saves it beside the model
    saved = load_processor(str(tmp_path / "saved"), processor_class(family))
    assert (saved.image_processor.size["shortest_edge"], saved.image_processor.size["longest_edge"]) == (
        9 * token, 16 * token)


def test_a_row_too_long_names_each_images_tokens_and_the_pixel_bound(vlm_dirs, tmp_path):  # noqa: F811
    path = _rows(tmp_path, [(20 * 14, 20 * 14)])
    with pytest.raises(DataError) as err:
        _tokens_per_image(vlm_dirs["qwen2_5_vl"], path, max_length=68)
    said = str(err.value)
    assert "rows.jsonl:1" in said and "128 tokens is more than data.max_length=68" in said
    assert "64 of them its images' (im0.png: 64 tokens)" in said and "lower data.image_max_pixels" in said
    # bounded, the image fits: 64 text tokens and 4 of it
    assert _tokens_per_image(vlm_dirs["qwen2_5_vl"], path, max_length=68, image_max_pixels=4 * 28 * 28)[0] == [4]


@pytest.mark.parametrize("family, why", [
    ("llava", "LLaVA resizes every image to its vision tower's size"),
    ("llava_next", "LLaVA-NeXT tiles every image on the grids of its config's image_grid_pinpoints"),
    ("gemma3", "Gemma 3 resizes every image to its vision tower's size"),
    ("idefics3", "Idefics3 splits every image into tiles of its image processor's max_image_size")])
def test_pixel_bounds_on_a_family_that_sizes_images_itself_are_refused(vlm_dirs, tmp_path, capsys, monkeypatch,  # noqa: F811
                                                                      family, why):
    checked, ran = refusals_of_check_and_run(tmp_path, vlm_dirs[family],
                                             lambda tree: tree["data"].update(image_max_pixels=50000), capsys,
                                             monkeypatch)
    for err in (checked, ran):
        assert f"data.image_max_pixels: {why}" in err and "remove data.image_max_pixels" in err


def test_pixel_bounds_out_of_order_or_on_a_text_model_are_refused(vlm_dirs, tiny_model_dir, tmp_path, capsys,  # noqa: F811
                                                                 monkeypatch):
    checked, ran = refusals_of_check_and_run(
        tmp_path, vlm_dirs["qwen2_5_vl"], lambda tree: tree["data"].update(image_min_pixels=9000,
                                                                           image_max_pixels=4000), capsys, monkeypatch)
    for err in (checked, ran):
        assert "data.image_min_pixels: 9000 is more than data.image_max_pixels (4000); lower it" in err
    checked, ran = refusals_of_check_and_run(tmp_path, tiny_model_dir,
                                             lambda tree: tree["data"].update(image_max_pixels=4000), capsys,
                                             monkeypatch)
    for err in (checked, ran):
        assert "data.image_max_pixels: sizes the images of an image-text-to-text model's rows; this model reads " \
               "text only: remove data.image_max_pixels" in err
