"""Reading images so that an unreadable one is an ``ImageLoadError`` (skipped and counted by the trainer),
never a crash.

PIL signals an unreadable image in several ways: OSError (missing, truncated, not an image), ValueError,
SyntaxError (some malformed headers), and for an image over ``Image.MAX_IMAGE_PIXELS`` a
``DecompressionBombWarning`` (over the limit) or ``DecompressionBombError`` (over twice the limit), which
is neither OSError nor ValueError. The warning is treated as an error too: such an image would be decoded
whole into memory, and one sample is not worth that.
"""

from __future__ import annotations

import warnings

from PIL import Image


class ImageLoadError(ValueError):
    """An image file is missing or cannot be decoded."""


UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning)


def open_lazily(data: bytes, where: str) -> Image.Image:
    """An image cell's bytes opened (header only; pixels decoded when the policy uses it), or ImageLoadError."""
    import io

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except UNREADABLE as error:
        raise ImageLoadError(
            f"{where}: image bytes cannot be read: {type(error).__name__}: {error}"
        ) from error


def decode_image(image) -> Image.Image:
    """A path or (lazily opened) PIL image -> decoded RGB image, or ImageLoadError. A lazily opened image is
    left undecoded: the decoded copy belongs to the caller (one step's encoding) and goes with it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if isinstance(image, Image.Image):
                Image._decompression_bomb_check(image.size)  # a lazy image from bytes: checked at open only
                if getattr(image, "fp", None) is None:  # pixels in memory already (made, not read from a file)
                    return image.convert("RGB")
                # Lazily opened (open_lazily): decode through a handle of its own, so the sample keeps only the
                # header and the encoded bytes. convert() on the sample's image would load the pixels into it,
                # where they stay for the rest of the run (~0.9 MB per 640x480 image against ~0.2 MB of JPEG).
                image.fp.seek(0)
                with Image.open(image.fp) as fresh:
                    return fresh.convert("RGB")
            with Image.open(image) as opened:
                return opened.convert("RGB")
    except UNREADABLE as error:
        raise ImageLoadError(f"cannot load image {image!r}: {type(error).__name__}: {error}") from error


def header_size(image) -> tuple[int, int]:
    """(width, height) of a path or PIL image from its header only, or ImageLoadError (as ``decode_image``).

    Loaders call this: a missing file stays FileNotFoundError there (a wrong path or image root is a setup
    error, named at start), while a file that is present but unreadable is an ImageLoadError to skip."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if isinstance(image, Image.Image):
                Image._decompression_bomb_check(image.size)
                return image.size
            with Image.open(image) as opened:
                return opened.size
    except FileNotFoundError:
        raise
    except UNREADABLE as error:
        raise ImageLoadError(f"cannot read image {image!r}: {type(error).__name__}: {error}") from error
