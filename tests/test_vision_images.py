"""Images as the processor sees them (hftrain/vision/images.py open_rgb): what the run trains on is what the model's
processor makes of the same file at inference. A transparent background was trained black (PIL's convert drops the
alpha) where the processor composites it on white; a 16-bit grey PNG at 40% was trained pure white (PIL clips it)."""

import numpy as np
import pytest
from PIL import Image
from transformers import CLIPImageProcessor

from hftrain.vision.images import open_rgb


def _pixels(processor, image) -> np.ndarray:
    return np.asarray(processor(images=image, return_tensors="np")["pixel_values"])


def _half_transparent(mode: str) -> Image.Image:
    """8 x 8: the top half opaque red (grey in LA), the bottom half transparent, its colour stored as black."""
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    rgba[:4] = [200, 30, 30, 255]
    image = Image.fromarray(rgba, "RGBA")
    if mode != "P":
        return image.convert(mode)
    palette = Image.fromarray(rgba[..., :3], "RGB").quantize(colors=2)  # a palette with a transparent index
    palette.info["transparency"] = palette.getpixel((0, 7))
    return palette


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_a_transparent_image_is_trained_as_the_processor_sees_it_at_inference(tmp_path, mode):
    path = tmp_path / "t.png"
    _half_transparent(mode).save(path)
    processor = CLIPImageProcessor(do_resize=False, do_center_crop=False, do_convert_rgb=True)
    with Image.open(path) as original:
        at_inference = _pixels(processor, original.copy())
        dropped_alpha = _pixels(processor, original.convert("RGB"))  # the control: what was trained before
    trained = _pixels(processor, open_rgb(str(path)))
    assert np.array_equal(trained, at_inference)
    assert mode == "P" or not np.array_equal(dropped_alpha, at_inference)  # PIL whitens a palette's transparency
    assert tuple(np.asarray(open_rgb(str(path)))[7, 0]) == (255, 255, 255)  # the transparent half: white


@pytest.mark.parametrize("bits, mode", [(16, "I;16"), (16, "I"), (32, "F")])
def test_a_grey_image_of_more_than_8_bits_keeps_its_grey(tmp_path, bits, mode):
    """40% grey in 16 bits (a PNG PIL opens as I;16 or I) or as floats in [0, 1] (a TIFF, mode F): 102 of 255 in
    every channel; PIL's own convert clips it to 255 (the control)."""
    path = tmp_path / ("g.png" if mode == "I;16" else "g.tiff")  # PIL writes modes I and F as TIFF
    if mode == "F":
        Image.fromarray(np.full((4, 4), 0.4, dtype=np.float32), mode="F").save(path)
    else:
        Image.fromarray(np.full((4, 4), round(0.4 * 65535), dtype=np.uint16)).convert(mode).save(path)
    rgb = np.asarray(open_rgb(str(path)))
    assert rgb.shape == (4, 4, 3) and set(rgb.reshape(-1).tolist()) == {102}
    with Image.open(path) as original:
        assert original.mode in ("I;16", "I", "F")
        if mode != "F":
            assert set(np.asarray(original.convert("RGB")).reshape(-1).tolist()) == {255}
