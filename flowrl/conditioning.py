"""Conditioning inputs of a prompt beyond its text: images (the source image of an edit, several for multi-image
editing, the first frame of an image-to-video model).

A family declares how many conditioning images each prompt takes (`ImageBackend.condition_images`, a
(fewest, most) pair: (0, 0) for text-to-image, (1, 1) for single-image editing). A prompt's images travel as
absolute paths in its metadata column (`data.image_column`, checked when the prompt file is read, see
`flowrl.data`); `check_image_counts` checks the counts against the family before any model loads; the policy
loads them (`load_images`), each resized so that its sides are multiples of the model's size multiple, and
passes them to the family's rollout, one list per prompt."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageOps


def describe_count(accepts: tuple[int, int]) -> str:
    """How many conditioning images a (fewest, most) range allows, in words: "no image", "exactly 1 image",
    "1 to 3 images"."""
    low, high = accepts
    if high == 0:
        return "no conditioning image"
    noun = "image" if high == 1 else "images"
    return f"exactly {low} {noun}" if low == high else f"{low} to {high} {noun}"


def count_problem(count: int, accepts: tuple[int, int], family: str, fix: str = "") -> str:
    """Why `count` conditioning images do not suit a family taking `accepts` = (fewest, most) per prompt; "" when
    they do. `fix`: what to do instead of giving them to a text-to-image family (default: a prompt file's)."""
    low, high = accepts
    if low <= count <= high:
        return ""
    if high == 0:
        fix = fix or "or set data.image_column='' to keep the column as metadata only"
        return (
            f"{family} is a text-to-image family and takes no conditioning image, got {count}; use an "
            f"image-editing family, {fix}"
        )
    return f"{family} takes {describe_count(accepts)} per prompt, got {count}"


def image_count(meta: dict, column: str) -> int:
    """How many conditioning images a prompt's metadata holds in `column` (0 when it has none)."""
    value = (meta or {}).get(column) if column else None
    if value is None:
        return 0
    return 1 if isinstance(value, str) else len(value)


def check_image_counts(
    metadata: Sequence[dict], origins: Sequence[str], column: str, accepts: tuple[int, int], family: str
) -> None:
    """A ValueError naming the first prompt (its origin, "file:line") whose number of conditioning images in
    `column` the family does not take, and what it takes."""
    for meta, where in zip(metadata, origins, strict=True):
        problem = count_problem(image_count(meta, column), accepts, family)
        if problem:
            source = f" (column {column!r}, data.image_column)" if column else ""
            raise ValueError(f"{where}: {problem}{source}")


def fit_to_multiple(image: Image.Image, multiple: int) -> Image.Image:
    """`image` upright (turned as its EXIF orientation says, as a phone's photo is meant to be seen and diffusers'
    `load_image` turns it) as RGB with each side rounded down to a multiple of `multiple` pixels (at least one
    multiple), resized (bicubic) to that size; unchanged in size when it already fits."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    image = ImageOps.exif_transpose(image).convert("RGB")
    w, h = image.size
    size = (max(multiple, w // multiple * multiple), max(multiple, h // multiple * multiple))
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


def load_images(paths: Sequence[str] | str | None, multiple: int) -> list[Image.Image]:
    """A prompt's conditioning images from their paths (one path, a list, or None for none), each fitted to
    `multiple` (see `fit_to_multiple`: upright as their EXIF orientation says)."""
    if paths is None:
        return []
    paths = [paths] if isinstance(paths, str) else list(paths)
    out = []
    for path in paths:
        with Image.open(Path(path)) as im:
            out.append(fit_to_multiple(im, multiple))
    return out
