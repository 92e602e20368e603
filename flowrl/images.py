"""Image utilities: grids for eval outputs (captioned with their prompts and scores; a video is shown by a contact
sheet of its first, middle and last frames) and before/after comparisons."""

from __future__ import annotations

import math

from PIL import Image, ImageDraw, ImageFont, ImageOps

MAX_CAPTION_LINES = 2  # a row's caption wraps onto at most this many lines, then ends with an ellipsis


def open_upright(path) -> Image.Image:
    """The image file at `path` as RGB, upright: turned as its EXIF orientation says (a phone's portrait photo is
    stored sideways with a tag), as a viewer shows it and diffusers' `load_image` loads it."""
    with Image.open(path) as im:
        return ImageOps.exif_transpose(im).convert("RGB")


def upright_size(path) -> tuple[int, int]:
    """(width, height) of the image file at `path` as `open_upright` turns it (its header read, not its pixels)."""
    with Image.open(path) as im:
        w, h = im.size
        orientation = im.getexif().get(0x0112, 1)  # EXIF Orientation: 5-8 turn the image by a quarter
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def image_grid(
    images: list,
    cols: int | None = None,
    pad: int = 2,
    background=(255, 255, 255),
    *,
    row_labels: list[str] | None = None,
    cell_labels: list[str] | None = None,
) -> Image.Image:
    """Tile PIL images (all of one size) row-major into one image with `pad` pixels between them.

    row_labels: one caption per row (e.g. the row's prompt), drawn in a strip above the row, wrapped onto at most
        `MAX_CAPTION_LINES` lines of the grid's width (the strip as tall as that row's caption) and cut with an
        ellipsis beyond.
    cell_labels: one short label per image (e.g. its score, "0.73"), drawn in a strip under the image, so that
        the image itself stays whole however small it is.
    Without labels the grid is exactly the plain tiling (images and `pad` only)."""
    if not images:
        raise ValueError("image_grid needs at least one image")
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    for i, im in enumerate(images):
        if im.size != (w, h):
            raise ValueError(f"image {i} is {im.size}, expected {(w, h)} like the first")
    if row_labels is not None and len(row_labels) != rows:
        raise ValueError(
            f"row_labels has {len(row_labels)} labels for the grid's {rows} rows ({len(images)} images "
            f"in {cols} columns); give one label per row"
        )
    if cell_labels is not None and len(cell_labels) != len(images):
        raise ValueError(f"cell_labels has {len(cell_labels)} labels for {len(images)} images; give one per image")
    width = cols * w + (cols + 1) * pad
    caption_font, cell_font = label_font(caption_size(h)), label_font(cell_label_size(h))
    captions = [wrap_text(str(t), caption_font, width - 2 * pad) for t in row_labels] if row_labels is not None else []
    caption_h = [len(lines) * line_height(caption_font) + 4 for lines in captions] or [0] * rows  # per row
    cell_h = line_height(cell_font) + 2 if cell_labels is not None else 0
    tops = [pad + sum(caption_h[:r]) + r * (h + cell_h + pad) for r in range(rows)]  # where each row's strip starts
    grid = Image.new("RGB", (width, tops[-1] + caption_h[-1] + h + cell_h + pad), background)
    draw = ImageDraw.Draw(grid)
    ink = text_color(background)
    for r, lines in enumerate(captions):
        for k, line in enumerate(lines):
            draw.text((pad, tops[r] + 3 + k * line_height(caption_font)), line, fill=ink, font=caption_font)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        x, y = pad + c * (w + pad), tops[r] + caption_h[r]
        grid.paste(im.convert("RGB"), (x, y))
        if cell_labels is not None:
            text = fit_text(str(cell_labels[i]), cell_font, w)
            draw.text((x + (w - cell_font.getlength(text)) / 2, y + h + 1), text, fill=ink, font=cell_font)
    return grid


def eval_grid(images: list, prompts: list[str], scores=None, cols: int | None = None) -> Image.Image:
    """The grid of an evaluation's images, each row captioned with its prompts and each image with its score.

    images: [P * n] prompt-major (n images of prompt 0, then of prompt 1, ...); prompts: the P prompts (a prompt
    listed several times in a row, as `eval_plan` lists them, is one prompt with more images); scores: [P * n]
    numbers (a list or a tensor) or None. cols: n when n > 1, else up to 8 images a row (several prompts a row).
    A row holding several prompts is captioned "3x first prompt | 5x second prompt", left to right.
    A video sample (frames [F, H, W, C], `flowrl.video`) is shown as its contact sheet (`video.contact_sheet`)."""
    from .video import contact_sheet, is_video

    images = [contact_sheet(x) if is_video(x) else x for x in images]
    if not prompts or len(images) % len(prompts):
        raise ValueError(f"eval_grid: {len(images)} images do not split evenly over {len(prompts)} prompts")
    n = len(images) // len(prompts)
    cols = cols or (n if n > 1 else min(8, len(images)))
    per_image = [p for p in prompts for _ in range(n)]
    row_labels = [row_caption(per_image[i : i + cols]) for i in range(0, len(images), cols)]
    cell_labels = None if scores is None else [format_score(float(s)) for s in scores]
    return image_grid(images, cols=cols, row_labels=row_labels, cell_labels=cell_labels)


def row_caption(prompts: list[str]) -> str:
    """One row's caption from its images' prompts (left to right): the prompt when they are all one, else each
    run of equal prompts as "<count>x <prompt>", joined by " | "."""
    runs: list[list] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    if len(runs) == 1:
        return str(runs[0][0])
    return " | ".join(f"{k}x {p}" for p, k in runs)


def format_score(value: float) -> str:
    """A score as a short cell label: three significant digits (0.73, 22.4, 0.00123), "nan" for NaN."""
    return "nan" if math.isnan(value) else f"{value:.3g}"


# ------------------------------------------------------------------------------ text


def caption_size(image_height: int) -> int:
    """The caption font's size in pixels for a grid of images `image_height` tall (12 for 64 px images, up to 20)."""
    return max(12, min(20, image_height // 5))


def cell_label_size(image_height: int) -> int:
    """The cell label font's size in pixels (11 for 64 px images, up to 16)."""
    return max(11, min(16, image_height // 6))


def label_font(size: int):
    """Pillow's built-in font at `size` pixels (a scalable font from Pillow 10.1 with FreeType); with an older
    Pillow, its small fixed bitmap font."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: load_default() takes no size
        return ImageFont.load_default()


def line_height(font) -> int:
    """The height in pixels of one line of text in `font` (ascent + descent)."""
    if isinstance(font, ImageFont.FreeTypeFont):
        ascent, descent = font.getmetrics()
        return ascent + descent
    left, top, right, bottom = font.getbbox("Ag")
    return bottom + 2


def drawable(text: str, font) -> str:
    """`text` as `font` can draw it: a bitmap font holds Latin-1 only, so other characters become '?'."""
    if isinstance(font, ImageFont.FreeTypeFont):
        return text
    return text.encode("latin-1", "replace").decode("latin-1")


def ellipsis(font) -> str:
    """The ellipsis character when `font` can draw it, else three dots."""
    return "\u2026" if isinstance(font, ImageFont.FreeTypeFont) else "..."


def fit_text(text: str, font, width: float) -> str:
    """`text` on one line of at most `width` pixels: whole when it fits, else its longest prefix that fits with an
    ellipsis after it."""
    text = drawable(text, font)
    if font.getlength(text) <= width:
        return text
    dots = ellipsis(font)
    fits, too_long = 0, len(text)  # binary search on the prefix length: getlength grows with it
    while too_long - fits > 1:
        mid = (fits + too_long) // 2
        fits, too_long = (mid, too_long) if font.getlength(text[:mid].rstrip() + dots) <= width else (fits, mid)
    if fits:
        return text[:fits].rstrip() + dots
    return dots if font.getlength(dots) <= width else ""


def wrap_text(text: str, font, width: float, max_lines: int = MAX_CAPTION_LINES) -> list[str]:
    """`text` wrapped at spaces onto at most `max_lines` lines of at most `width` pixels each (a " | " separator
    ends a line rather than starting one); what does not fit is cut, and the last line then ends with an ellipsis.
    Always at least one line."""
    text = drawable(" ".join(text.split()), font)
    lines: list[str] = []
    words: list[str] = []
    for word in text.split(" "):  # a lone separator ("a | b") stays with the word before it, ending its line
        if word == "|" and words:
            words[-1] += " |"
        else:
            words.append(word)
    while words and len(lines) < max_lines:
        line = words.pop(0)
        while words and font.getlength(line + " " + words[0]) <= width:
            line += " " + words.pop(0)
        lines.append(line)
    if words:  # more text than lines: the last line shows that it goes on
        lines[-1] = fit_text(lines[-1] + " " + " ".join(words), font, width)
    return [fit_text(line, font, width) for line in lines] or [""]


def text_color(background) -> tuple[int, int, int]:
    """Black on a light background, white on a dark one (`background`: anything `Image.new` takes as a colour)."""
    r, g, b = Image.new("RGB", (1, 1), background).getpixel((0, 0))
    return (0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b >= 128 else (255, 255, 255)


# ------------------------------------------------------------------------------ before / after


def before_after(before_path, after_path, out_path, labels=("before", "after"), pad: int = 6):
    """Two grids side by side with a caption strip above each; written atomically to `out_path`."""
    from pathlib import Path

    a, b = Image.open(before_path).convert("RGB"), Image.open(after_path).convert("RGB")
    font = label_font(max(14, min(24, max(a.width, b.width) // 30)))
    caption = line_height(font) + 6
    w = a.width + b.width + 3 * pad
    h = max(a.height, b.height) + caption + 2 * pad
    canvas = Image.new("RGB", (w, h), (255, 255, 255))
    canvas.paste(a, (pad, caption + pad))
    canvas.paste(b, (2 * pad + a.width, caption + pad))
    draw = ImageDraw.Draw(canvas)
    draw.text((pad, pad), fit_text(str(labels[0]), font, a.width), fill=(0, 0, 0), font=font)
    draw.text((2 * pad + a.width, pad), fit_text(str(labels[1]), font, b.width), fill=(0, 0, 0), font=font)
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.stem + ".tmp.png")
    canvas.save(tmp)
    tmp.replace(out_path)
    return out_path
