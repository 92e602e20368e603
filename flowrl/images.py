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


def before_after(before_path, after_path, out_path, labels=("before", "after"), pad: int = 6):
    """Two grids side by side with a caption strip above each; written atomically to `out_path`."""
    from pathlib import Path

    from PIL import ImageDraw

    a, b = Image.open(before_path).convert("RGB"), Image.open(after_path).convert("RGB")
    caption = 18
    w = a.width + b.width + 3 * pad
    h = max(a.height, b.height) + caption + 2 * pad
    canvas = Image.new("RGB", (w, h), (255, 255, 255))
    canvas.paste(a, (pad, caption + pad))
    canvas.paste(b, (2 * pad + a.width, caption + pad))
    draw = ImageDraw.Draw(canvas)
    draw.text((pad, 3), labels[0], fill=(0, 0, 0))
    draw.text((2 * pad + a.width, 3), labels[1], fill=(0, 0, 0))
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.stem + ".tmp.png")
    canvas.save(tmp)
    tmp.replace(out_path)
    return out_path
