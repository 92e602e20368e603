"""Write samples/edit/: a few source images (plain shapes on a light background, 256 x 256 PNG) and editing
instructions for them, `train.jsonl` and `test.jsonl` with an `image` column relative to the files. They are what the
editing presets (configs/flux_kontext_edit.yaml, configs/qwen_image_edit_plus_pickscore.yaml) train on out of the
box: a placeholder for a real editing set (Flow-GRPO's counting_edit, Flow-Factory's sharegpt4o_image_mini).

    python scripts/make_edit_samples.py
"""

import json
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "samples" / "edit"
SIZE = 256
#: (file, shapes drawn: (kind, colour, box)), each with its instructions
SOURCES = [
    ("red_circle.png", [("circle", (200, 40, 40), (64, 64, 192, 192))],
     ["make the circle blue", "add a green square to the right of the circle"]),
    ("blue_square.png", [("square", (40, 60, 200), (72, 72, 184, 184))],
     ["turn the square into a circle", "make the square yellow"]),
    ("two_shapes.png", [("circle", (40, 160, 60), (24, 80, 120, 176)), ("square", (220, 180, 30), (140, 80, 236, 176))],
     ["swap the colours of the two shapes", "remove the circle"]),
    ("three_circles.png", [("circle", (200, 40, 40), (16, 96, 80, 160)), ("circle", (200, 40, 40), (96, 96, 160, 160)),
                           ("circle", (200, 40, 40), (176, 96, 240, 160))],
     ["add one more circle", "make the middle circle blue"]),
]
TEST = {"three_circles.png"}  # held out for eval


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


if __name__ == "__main__":
    main()
