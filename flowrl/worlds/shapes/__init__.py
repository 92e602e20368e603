"""The shapes world: a procedural renderer, GenEval-style prompts with a train/test split, and a detector.

It is the embedded default of flowrl: a tiny `StableDiffusion3Pipeline` pre-trained on this world ships in
`samples/shapes/model` (made by `scripts/pretrain_shapes.py`), and `score_images` is the compositional
reward GRPO raises. Two more tasks live in this world: editing (`flowrl.worlds.shapes.edit`: a source scene and
an instruction, checked exactly) and video (`flowrl.worlds.shapes.motion`: a shape moving across the frames). Pure
numpy; the model-building helpers in `flowrl.worlds.shapes.model` need torch/diffusers.
"""

from .detect import FAILURE_KINDS, Detection, check_clauses, detect_objects, diagnose, score_images
from .prompts import (
    FAMILIES,
    all_prompts,
    combination_key,
    load_jsonl,
    make_record,
    prompt_text,
    prompts_of_split,
    split_of,
    vocabulary,
    write_jsonl,
)
from .render import (
    BACKGROUND,
    COLORS,
    IMAGE_SIZE,
    RELATIONS,
    SHAPES,
    ShapeObject,
    add_distractor,
    draw,
    render,
    sample_scene,
)

__all__ = [
    "BACKGROUND",
    "COLORS",
    "Detection",
    "FAILURE_KINDS",
    "FAMILIES",
    "IMAGE_SIZE",
    "RELATIONS",
    "SHAPES",
    "ShapeObject",
    "add_distractor",
    "all_prompts",
    "check_clauses",
    "combination_key",
    "detect_objects",
    "diagnose",
    "draw",
    "load_jsonl",
    "make_record",
    "prompt_text",
    "prompts_of_split",
    "render",
    "sample_scene",
    "score_images",
    "split_of",
    "vocabulary",
    "write_jsonl",
]
