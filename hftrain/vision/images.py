"""Images read in the data phase, before any model loads: each opened, verified, decoded whole and measured with PIL,
so that a missing, unreadable, truncated or over-large image stops the run with a DataError naming the file, the row
and the image, never a traceback in the collator mid-run."""

from __future__ import annotations

import hashlib
import io
import os
import warnings

from PIL import Image, UnidentifiedImageError

from ..data.cache import cache_folder
from ..errors import DataError
from ..fileio import atomic_write

# The most pixels an image may have (width x height): 8192 x 8192. Larger images are almost always a mistake (a scan
# at print resolution) and cost memory in the processor before it resizes them; PIL's own bomb guard is above this.
MAX_IMAGE_PIXELS = 8192 * 8192


def image_path(value, base: str, what: str) -> str:
    """The local file an image entry names: a path relative to the data file's folder, or absolute; or, for an image
    the rows hold (a datasets Image feature: {"bytes", "path"} undecoded, a PIL image decoded), the file it is kept
    in (held_image)."""
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
        value = value["bytes"] if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, Image.Image)):
        return held_image(value, what)
    if not isinstance(value, str) or not value:
        raise DataError(f"{what} is {type(value).__name__} {str(value)[:80]!r} where the path of an image file is "
                        "expected (relative to the data file)")
    if value.startswith(("http://", "https://")):
        raise DataError(f"{what} is a URL ({value[:80]}); hftrain reads local image files only: download it and "
                        "give its path relative to the data file")
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(base, value))


def image_store() -> str:
    """Where the images rows hold as bytes are kept as files, one per content: beside hftrain's data cache."""
    return os.path.join(cache_folder(), "images")


def held_image(value, what: str) -> str:
    """The file of an image held in a row (its encoded bytes, or a decoded PIL image saved as PNG, lossless), named
    by the SHA-256 of those bytes in image_store(): written once (fileio.atomic_write), found again by every later
    read. Every later step (the checks, the processor, the collator) reads it as any image file."""
    if isinstance(value, Image.Image):
        encoded = io.BytesIO()
        value.save(encoded, format="PNG")
        value = encoded.getvalue()
    digest = hashlib.sha256(value).hexdigest()
    folder = image_store()
    path = os.path.join(folder, digest)
    if not os.path.isfile(path):
        try:
            os.makedirs(folder, exist_ok=True)
            atomic_write(path, value)
        except OSError as e:
            raise DataError(f"{what}: the image the row holds cannot be kept in {folder} ({e.strerror or e}): make "
                            "it writable, or point HF_DATASETS_CACHE at a writable folder") from None
    return path


def check_image(path: str, what: str, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of the image file at `path`, opened, verified and decoded whole; else a DataError naming
    `what` (the file, the row and the image). `max_pixels`: MAX_IMAGE_PIXELS unless given."""
    max_pixels = MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if not os.path.isfile(path):
        raise DataError(f"{what}: image {path} does not exist; fix the path (relative to the data file) or add "
                        "the file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                size = image.size
                if size[0] * size[1] > max_pixels:
                    raise DataError(f"{what}: image {path} is {size[0]} x {size[1]} pixels, more than the "
                                    f"{max_pixels} hftrain reads; resize it")
                image.verify()  # the file's structure (checksums of PNG chunks)
            with Image.open(path) as image:
                image.load()  # every pixel decoded: a truncated file fails here
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DataError(f"{what}: image {path} is too large to decode safely ({e}); resize it") from None
    except UnidentifiedImageError:
        raise DataError(f"{what}: {path} is not an image PIL can read; convert it to PNG or JPEG") from None
    except (OSError, SyntaxError, ValueError) as e:  # PIL: "image file is truncated", broken chunks (SyntaxError)
        raise DataError(f"{what}: image {path} is damaged or truncated ({e}); replace the file") from None
    return size


def open_rgb(path: str) -> Image.Image:
    """The image as the processor gets it: decoded, RGB, as a processor converts it at inference (transformers'
    convert_to_rgb: transparency composited on white; PIL's own convert("RGB") drops the alpha, so a transparent
    background trained as black), and a 16- or 32-bit grey image scaled to 8 bits (PIL clips it: 40% grey trained
    as pure white)."""
    from transformers.image_transforms import convert_to_rgb

    with Image.open(path) as image:
        image.load()
        return Image.fromarray(convert_to_rgb(_eight_bit(image), return_numpy=True))


def _eight_bit(image: Image.Image) -> Image.Image:
    """A grey image of more than 8 bits per pixel (PIL modes I;16*, I: 16-bit PNGs and TIFFs; F: floats in [0, 1])
    as 8-bit grey, by its full range; any other image as it is."""
    import numpy as np

    if image.mode.startswith("I;16") or image.mode == "I":
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or values.max() > 255 else 255.0
    elif image.mode == "F":
        values, top = np.asarray(image, dtype=np.float64), 1.0
    else:
        return image
    return Image.fromarray(np.clip(np.rint(values * (255.0 / top)), 0, 255).astype(np.uint8), mode="L")
