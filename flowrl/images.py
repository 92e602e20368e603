"""Image utilities: grids for eval outputs and before/after comparisons."""

from __future__ import annotations

import math

from PIL import Image


def image_grid(images: list, cols: int | None = None, pad: int = 2, background=(255, 255, 255)) -> Image.Image:
    """Tile PIL images (all of one size) row-major into one image with `pad` pixels between them."""
    if not images:
        raise ValueError("image_grid needs at least one image")
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w + (cols + 1) * pad, rows * h + (rows + 1) * pad), background)
    for i, im in enumerate(images):
        if im.size != (w, h):
            raise ValueError(f"image {i} is {im.size}, expected {(w, h)} like the first")
        r, c = divmod(i, cols)
        grid.paste(im.convert("RGB"), (pad + c * (w + pad), pad + r * (h + pad)))
    return grid
