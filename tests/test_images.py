"""Eval grids captioned with prompts and scores, and the before/after picture."""

import random

import pytest
from PIL import Image, ImageFont

from flowrl import images
from flowrl.images import (
    MAX_CAPTION_LINES,
    before_after,
    eval_grid,
    format_score,
    image_grid,
    label_font,
    row_caption,
    wrap_text,
)

WHITE = (255, 255, 255)


def noise_images(n, size=(5, 4), seed=0):
    """n images of random pixels: any misplaced or overdrawn pixel shows."""
    rng = random.Random(seed)
    return [
        Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))) for _ in range(n)
    ]


def solid_images(n, size=64):
    """n images of distinct saturated colours (none grey, so text ink never takes their colour)."""
    colours = [(250, 20 + 23 * i, 10) if i % 2 else (10, 20 + 23 * i, 250) for i in range(n)]
    return [Image.new("RGB", (size, size), c) for c in colours], colours


def is_ink(pixel):
    """A dark grey pixel: drawn text (black, anti-aliased) on a white background."""
    return max(pixel) < 160 and max(pixel) - min(pixel) < 30


def ink_rows(im, box):
    """The y coordinates inside `box` (left, top, right, bottom) that hold text ink."""
    left, top, right, bottom = box
    return [y for y in range(top, bottom) if any(is_ink(im.getpixel((x, y))) for x in range(left, right))]


@pytest.mark.parametrize("cols,pad,background", [(3, 2, WHITE), (None, 5, (10, 20, 30)), (7, 0, WHITE)])
def test_a_grid_without_labels_is_the_plain_tiling_pixel_for_pixel(cols, pad, background):
    ims = noise_images(7)
    w, h = ims[0].size
    c = cols or 3  # ceil(sqrt(7))
    rows = -(-7 // c)
    expected = Image.new("RGB", (c * w + (c + 1) * pad, rows * h + (rows + 1) * pad), background)
    for i, im in enumerate(ims):
        r, k = divmod(i, c)
        expected.paste(im, (pad + k * (w + pad), pad + r * (h + pad)))
    got = image_grid(ims, cols=cols, pad=pad, background=background)
    assert got.size == expected.size and got.tobytes() == expected.tobytes()


def test_row_captions_sit_above_their_rows_and_leave_every_image_whole():
    ims, colours = solid_images(6)
    grid = image_grid(ims, cols=3, row_labels=["a red circle", "two blue squares"])
    counts = {colour: n for n, colour in grid.getcolors(1 << 16)}
    assert all(counts.get(c) == 64 * 64 for c in colours)  # no caption pixel on any image
    first_top = next(y for y in range(grid.height) if grid.getpixel((3, y)) == colours[0])
    second_top = next(y for y in range(grid.height) if grid.getpixel((3, y)) == colours[3])
    assert ink_rows(grid, (0, 0, grid.width, first_top))  # the first caption, above the first row
    assert ink_rows(grid, (0, first_top + 64, grid.width, second_top))  # the second, between the rows
    assert len(ink_rows(grid, (0, 0, grid.width, first_top))) >= 8  # letters a reader can read, not a 1-px smear


def test_a_long_caption_wraps_to_the_grid_width_and_ends_with_an_ellipsis():
    font = label_font(12)
    text = " ".join(f"word{i}" for i in range(60))
    lines = wrap_text(text, font, 150)
    assert len(lines) == MAX_CAPTION_LINES
    assert all(font.getlength(line) <= 150 for line in lines)
    assert lines[-1].endswith("\u2026")
    assert text.startswith(lines[0] + " ")
    assert wrap_text("a red circle", font, 150) == ["a red circle"]
    # a separator ends a line rather than starting the next one
    assert not any(line.startswith("|") for line in wrap_text("3x aaaa bbbb cccc | 5x dddd eeee", font, 60, 4))


def test_cell_labels_go_under_tiny_images_and_hide_none_of_them():
    ims, colours = solid_images(4)
    grid = image_grid(ims, cols=4, cell_labels=["0.73", "1", "0", "22.4"])
    counts = {colour: n for n, colour in grid.getcolors(1 << 16)}
    assert all(counts.get(c) == 64 * 64 for c in colours)
    top = next(y for y in range(grid.height) if grid.getpixel((3, y)) == colours[0])
    for i in range(4):
        left = 2 + i * 66
        ink = ink_rows(grid, (left, top + 64, left + 64, grid.height))
        assert len(ink) >= 7  # a digit's height: legible
    assert grid.height > 64 + 2 * 2  # taller than the plain grid: the labels have their own strip


def test_label_lists_of_the_wrong_length_name_both_lengths():
    ims = noise_images(5)
    with pytest.raises(ValueError, match="row_labels has 1 labels for the grid's 2 rows"):
        image_grid(ims, cols=3, row_labels=["only one"])
    with pytest.raises(ValueError, match="cell_labels has 4 labels for 5 images"):
        image_grid(ims, cols=3, cell_labels=["1", "2", "3", "4"])


def test_row_caption_counts_the_prompts_of_a_row_that_holds_several():
    assert row_caption(["a cat"] * 4) == "a cat"
    assert row_caption(["a cat", "a cat", "a cat", "a dog"]) == "3x a cat | 1x a dog"
    assert row_caption(["a", "b", "a"]) == "1x a | 1x b | 1x a"  # runs, in the order drawn


def test_format_score_keeps_three_significant_digits():
    assert [format_score(v) for v in (0.7312, 22.4137, 0.001234, 1.0, float("nan"))] == [
        "0.731",
        "22.4",
        "0.00123",
        "1",
        "nan",
    ]


def test_eval_grid_puts_one_prompt_a_row_with_its_scores():
    ims = noise_images(6, size=(64, 64))
    scores = [0.5, 0.25, 1.0, 0.0, 0.125, 0.75]
    got = eval_grid(ims, ["a red circle", "two squares"], scores)  # 3 images per prompt: one row each
    want = image_grid(
        ims, cols=3, row_labels=["a red circle", "two squares"], cell_labels=["0.5", "0.25", "1", "0", "0.125", "0.75"]
    )
    assert got.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="5 images do not split evenly over 2 prompts"):
        eval_grid(ims[:5], ["a", "b"])


def test_eval_grid_with_one_image_a_prompt_captions_each_row_with_its_prompts():
    ims = noise_images(10, size=(64, 64))
    prompts = ["a cat"] * 6 + ["a dog"] * 4  # eval_plan lists a prompt once per image
    got = eval_grid(ims, prompts, cols=8)
    want = image_grid(ims, cols=8, row_labels=["6x a cat | 2x a dog", "a dog"])
    assert got.tobytes() == want.tobytes()


def test_labels_work_with_the_bitmap_font_of_an_older_pillow(monkeypatch):
    """Pillow < 10.1 has no sized default font and its bitmap font draws Latin-1 only."""
    bitmap = ImageFont.load_default_imagefont()

    def old_load_default(size=None):
        if size is not None:
            raise TypeError("load_default() got an unexpected keyword argument 'size'")
        return bitmap

    monkeypatch.setattr(images.ImageFont, "load_default", old_load_default)
    ims, colours = solid_images(2)
    grid = eval_grid(ims, ["un caf\u00e9 \u2615 " + "tr\u00e8s long " * 20], [0.5, float("nan")])
    top = next(y for y in range(grid.height) if grid.getpixel((3, y)) == colours[0])
    assert ink_rows(grid, (0, 0, grid.width, top))
    assert wrap_text("x " * 200, bitmap, 100)[-1].endswith("...")


def test_before_after_of_labelled_grids_keeps_captions_in_their_halves(tmp_path):
    ims, _ = solid_images(4)
    for name in ("before", "after"):
        eval_grid(ims, ["a red circle", "two squares"], [0.5, 1, 0, 0.25]).save(tmp_path / f"{name}.png")
    out = before_after(
        tmp_path / "before.png",
        tmp_path / "after.png",
        tmp_path / "ba.png",
        labels=("before: " + "a very long metric name " * 10, "after: 0.503"),
    )
    with Image.open(tmp_path / "before.png") as a, Image.open(out) as im:
        im = im.convert("RGB")
        split = 6 + a.width  # the gap between the two grids
        caption_rows = ink_rows(im, (0, 0, split, 6 + 30))
        assert caption_rows and not ink_rows(im, (split, 0, split + 6, 6 + 30))  # the long label is cut at its grid
        assert len(ink_rows(im, (split + 6, 0, im.width, 6 + 30))) >= 10  # "after: 0.503", at a readable size
