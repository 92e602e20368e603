"""Write samples/edit/: a few source images (plain shapes on a light background, 256 x 256 PNG) and editing
instructions for them, `train.jsonl` and `test.jsonl` with an `image` column relative to the files; and
samples/i2v/{train,test}.jsonl: motion prompts starting from the same images (first frames). They are what the
editing presets (configs/flux_kontext_edit.yaml, configs/qwen_image_edit_plus_pickscore.yaml) and the image-to-video
preset (configs/wan21_i2v_pickscore.yaml) train on out of the box: placeholders for real sets (Flow-GRPO's
counting_edit, Flow-Factory's sharegpt4o_image_mini).

    python scripts/make_edit_samples.py
"""

import json
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "samples" / "edit"
SIZE = 256
#: (file, shapes drawn: (kind, colour, box)), each with its instructions
SOURCES = [
    (
        "red_circle.png",
        [("circle", (200, 40, 40), (64, 64, 192, 192))],
        ["make the circle blue", "add a green square to the right of the circle"],
    ),
    (
        "blue_square.png",
        [("square", (40, 60, 200), (72, 72, 184, 184))],
        ["turn the square into a circle", "make the square yellow"],
    ),
    (
        "two_shapes.png",
        [("circle", (40, 160, 60), (24, 80, 120, 176)), ("square", (220, 180, 30), (140, 80, 236, 176))],
        ["swap the colours of the two shapes", "remove the circle"],
    ),
    (
        "three_circles.png",
        [
            ("circle", (200, 40, 40), (16, 96, 80, 160)),
            ("circle", (200, 40, 40), (96, 96, 160, 160)),
            ("circle", (200, 40, 40), (176, 96, 240, 160)),
        ],
        ["add one more circle", "make the middle circle blue"],
    ),
]
TEST = {"three_circles.png"}  # held out for eval
#: first frame -> what happens next (samples/i2v)
MOTIONS = {
    "red_circle.png": ["the red circle rolls slowly to the right", "the red circle bounces up and down"],
    "blue_square.png": ["the blue square spins in place", "the blue square slides to the left"],
    "two_shapes.png": ["the circle and the square move towards each other"],
    "three_circles.png": ["the three circles drift apart"],
}


def draw(shapes) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (235, 235, 228))
    pen = ImageDraw.Draw(image)
    for kind, colour, box in shapes:
        (pen.ellipse if kind == "circle" else pen.rectangle)(box, fill=colour)
    return image


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = {"train": [], "test": []}
    for name, shapes, instructions in SOURCES:
        draw(shapes).save(OUT / name)
        split = "test" if name in TEST else "train"
        rows[split] += [{"prompt": text, "image": name} for text in instructions]
    for split, items in rows.items():
        (OUT / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    i2v = OUT.parent / "i2v"
    i2v.mkdir(exist_ok=True)
    for split in ("train", "test"):
        items = [
            {"prompt": text, "image": f"../edit/{name}"}
            for name, texts in MOTIONS.items()
            for text in texts
            if (name in TEST) == (split == "test")
        ]
        (i2v / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))


if __name__ == "__main__":
    main()
