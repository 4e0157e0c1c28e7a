"""`hftrain data` on an image recipe (issue 58): each row shown with its images as placeholders naming the image, its
size and its token count, the trained tokens marked, and the image tokens counted as the processor expands them."""

from __future__ import annotations

import re

import pytest
from PIL import Image

from hftrain.vision.families import CHECKED
from hftrain.vision.processor import load_processor

from .test_vision import FAMILIES, PROCESSORS, _recipe, _square_rows, vlm_dirs  # noqa: F401, F811


def tokens_by_hand(processor, family: str, path) -> int:
    """One image's token count: Qwen-VL one token per 2 x 2 merged patches of its resized grid, LLaVA (image size /
    patch)^2 = 16 for the tiny model's 56 x 56, Gemma 3 its pooled 4, LLaVA-NeXT the processor's count for the
    image's size (its overview, tiles and row ends)."""
    if family in ("llava", "gemma3"):
        return 16 if family == "llava" else 4
    if family == "idefics3":  # 4 tokens per tile and 4 for the whole view
        width, height = Image.open(path).size
        return 4 * (processor.image_processor.get_number_of_image_patches(height, width, {})[0] or 1)
    if family == "llava_next":
        width, height = Image.open(path).size
        return processor._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0]
    grid = processor.image_processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod()) // 4


@pytest.mark.parametrize("family", FAMILIES)
def test_hftrain_data_shows_image_rows_with_placeholders_and_counts_image_tokens(
        vlm_dirs, tmp_path, capsys, family):  # noqa: F811
    from hftrain.cli import main

    data = _square_rows(tmp_path, 8)
    recipe = _recipe(tmp_path, vlm_dirs[family], data, str(tmp_path / "out"))
    processor = load_processor(vlm_dirs[family], PROCESSORS[family])
    counts = [tokens_by_hand(processor, family, tmp_path / f"square{i}.png") for i in range(8)]
    capsys.readouterr()
    assert main(["data", recipe, "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "image rows, 8 rows -> 8 examples, 8 images" in out
    assert (f"image tokens: total {sum(counts)}, per example min {min(counts)}, max {max(counts)} (never trained)"
            in out), out
    sizes = [Image.open(tmp_path / f"square{i}.png").size for i in range(2)]
    for i in range(2):  # the first two rows, each image one placeholder, the answer trained
        assert f"--- row {i}: " in out and f"({counts[i]} image tokens), " in out
        assert f"<image 0: square{i}.png {sizes[i][0]}x{sizes[i][1]}, {counts[i]} tokens>" in out, out
    assert re.search(r"\[\[ ?red", out) and CHECKED[family].feature_token not in out  # no raw image tokens printed
