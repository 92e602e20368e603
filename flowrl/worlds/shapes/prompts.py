"""Prompts of the shapes world in GenEval's six families, with metadata and a train/test split.

Every prompt is a record (one JSONL line):

    {"prompt": "a photo of a red circle and a blue square", "family": "color_attr",
     "objects": [{"shape": "circle", "color": "red", "count": 1},
                 {"shape": "square", "color": "blue", "count": 1}],
     "relation": null, "combination": "circle/red/1+square/blue/1", "split": "train"}

`relation` is `null` or one of "left of", "right of", "above", "below", read as
`objects[0] <relation> objects[1]`. `color` is `null` where the prompt names no colour (the renderer then
picks one at random). Families and templates (GenEval's tags and wording):

    single_object  "a photo of a circle"                       3 prompts
    two_object     "a photo of a circle and a square"          6 prompts (both orders)
    counting       "a photo of three triangles"                9 prompts (counts 2-4)
    colors         "a photo of a red circle"                   12 prompts
    position       "a photo of a circle left of a square"      24 prompts
    color_attr     "a photo of a red circle and a blue square" 72 prompts (distinct shapes and colours)

Split rule (`split_of`): prompts that mean the same thing share a *combination* ("a circle left of a square"
= "a square right of a circle"; the order of "A and B" does not matter), and a combination goes wholly to one
split, so every test combination is one never seen as a training prompt. With shape indices circle 0,
square 1, triangle 2 and colour indices red 0, green 1, blue 2, yellow 3, a combination's checksum is

    sum over its objects of (shape index + 1) + (colour index + 1, if a colour is named) + count
    + (1 for a horizontal relation, 2 for a vertical one)

and it is a test combination iff `checksum % 4 == 3`. This holds out about a quarter of each family
(1/3 single, 1/3 two-object, 2/9 counting, 3/12 colours, 4/12 position, 8/36 colour attribution) while
every shape, colour, count and relation, and every (colour, shape) pair, still occurs in training: the test
asks for new combinations of known parts (e.g. "two circles", "a circle above a square", "a blue triangle").

Validation split (`validation_combinations`): settings (objective, lr, epochs) are chosen on prompts held out of
the *training* prompts, so that the test split is read once per reported setting. Within each family the training
combinations, sorted by their combination key, at positions 1, 5, 9, ... (every fourth, from the second) are
validation combinations: 15 of the 56 (1 of 2 single, 1 of 2 two-object, 2 of 7 counting, 2 of 9 colours, 2 of 8
position, 7 of 28 colour attribution), 25 of the 94 training prompts. `prompts_of_split("val")` gives them and
`prompts_of_split("train_minus_val")` the 69 training prompts left to train on when validating; "train" is still
every training prompt (what the model was pre-trained on, and the demo trains on).
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from pathlib import Path

from .render import COLORS, RELATIONS, SHAPES

FAMILIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three", 4: "four"}
PLURALS: dict[str, str] = {s: s + "s" for s in SHAPES}
TEST_MODULUS, TEST_REMAINDER = 4, 3

_HORIZONTAL, _VERTICAL = ("left of", "right of"), ("above", "below")
_CANONICAL = {"right of": "left of", "below": "above"}  # "A right of B" is "B left of A"


def _obj(shape: str, color: str | None = None, count: int = 1) -> dict:
    return {"shape": shape, "color": color, "count": count}


def _noun(o: dict) -> str:
    """'a red circle', 'a square', 'three triangles'."""
    if o["count"] > 1:
        return f"{COUNT_WORDS[o['count']]} {PLURALS[o['shape']]}"
    return "a " + (f"{o['color']} " if o["color"] else "") + o["shape"]


def prompt_text(objects: list[dict], relation: str | None = None) -> str:
    """The prompt for some metadata: 'a photo of ' + the objects, joined by 'and' or the relation."""
    if relation is not None:
        if relation not in RELATIONS:
            raise ValueError(f"unknown relation {relation!r}; expected one of {RELATIONS}")
        return f"a photo of {_noun(objects[0])} {relation} {_noun(objects[1])}"
    return "a photo of " + " and ".join(_noun(o) for o in objects)


EXAMPLE_OBJECT = '{"shape": "circle", "color": "red", "count": 1}'


def metadata_problem(row: dict) -> str:
    """Why a prompt's metadata (`row`: its `objects` and `relation` columns) is not a record of this world that the
    detector can check (`check_clauses`), or "" when it is: `objects` a non-empty list of objects, each a shape of
    SHAPES, a colour of COLORS or null, and a whole count >= 1, one entry per shape; `relation` null or one of
    RELATIONS, between exactly two objects. A value outside the world would be scored as never holding."""
    objects, relation = row.get("objects"), row.get("relation")
    if not isinstance(objects, list) or not objects:
        return f"'objects' must be a non-empty list of objects such as {EXAMPLE_OBJECT}, got {_shown(objects)}"
    seen = set()
    for k, o in enumerate(objects):
        where = f"objects[{k}]"
        if not isinstance(o, dict):
            return f"{where} must be an object such as {EXAMPLE_OBJECT}, got {_shown(o)}"
        if o.get("shape") not in SHAPES:
            return f"{where}: 'shape' must be one of {list(SHAPES)}, got {_shown(o.get('shape'))}"
        if o.get("color") is not None and o["color"] not in COLORS:
            return f"{where}: 'color' must be one of {list(COLORS)} or null (no colour named), got {_shown(o['color'])}"
        count = o.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            return f"{where}: 'count' must be a whole number >= 1, got {_shown(count)}"
        if o["shape"] in seen:
            return f"{where}: a second {o['shape']!r}; the objects of one shape are one entry, with their 'count'"
        seen.add(o["shape"])
    if relation is not None:
        if relation not in RELATIONS:
            return f"'relation' must be null or one of {list(RELATIONS)}, got {_shown(relation)}"
        if len(objects) != 2:
            return f"'relation' {relation!r} relates objects[0] to objects[1]: it needs 2 objects, got {len(objects)}"
    return ""


def _shown(value) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def combination_key(objects: list[dict], relation: str | None = None) -> str:
    """A canonical name shared by all prompts that mean the same thing.

    'circle/red/1+square/blue/1' (objects sorted), 'circle/-/1 left of square/-/1' ("right of" and "below"
    are rewritten as "left of" and "above" with the objects swapped).
    """
    names = [f"{o['shape']}/{o['color'] or '-'}/{o['count']}" for o in objects]
    if relation is None:
        return "+".join(sorted(names))
    a, b = names
    if relation in _CANONICAL:
        a, b, relation = b, a, _CANONICAL[relation]
    return f"{a} {relation} {b}"


def checksum(objects: list[dict], relation: str | None = None) -> int:
    """The split rule's checksum (see the module docstring); symmetric in the objects."""
    total = 0
    for o in objects:
        total += SHAPES.index(o["shape"]) + 1 + o["count"]
        if o["color"] is not None:
            total += list(COLORS).index(o["color"]) + 1
    if relation is not None:
        total += 1 if relation in _HORIZONTAL else 2
    return total


def split_of(objects: list[dict], relation: str | None = None) -> str:
    """'test' iff checksum % 4 == 3, else 'train'."""
    return "test" if checksum(objects, relation) % TEST_MODULUS == TEST_REMAINDER else "train"


def make_record(family: str, objects: list[dict], relation: str | None = None) -> dict:
    """A full prompt record (prompt text, family, metadata, combination, split)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return {
        "prompt": prompt_text(objects, relation),
        "family": family,
        "objects": objects,
        "relation": relation,
        "combination": combination_key(objects, relation),
        "split": split_of(objects, relation),
    }


def all_prompts() -> list[dict]:
    """Every prompt of the world, family by family, in a fixed order (126 records)."""
    records = [make_record("single_object", [_obj(s)]) for s in SHAPES]
    records += [make_record("two_object", [_obj(a), _obj(b)]) for a, b in itertools.permutations(SHAPES, 2)]
    records += [make_record("counting", [_obj(s, None, n)]) for s in SHAPES for n in COUNT_WORDS]
    records += [make_record("colors", [_obj(s, c)]) for s in SHAPES for c in COLORS]
    records += [
        make_record("position", [_obj(a), _obj(b)], rel)
        for a, b in itertools.permutations(SHAPES, 2)
        for rel in RELATIONS
    ]
    records += [
        make_record("color_attr", [_obj(a, ca), _obj(b, cb)])
        for a, b in itertools.permutations(SHAPES, 2)
        for ca, cb in itertools.permutations(COLORS, 2)
    ]
    return records


#: Out-of-template prompts (`out_of_template_prompts`): other wordings of the relations and counts, and colours
#: combined with counts and with positions, which no training prompt does.
RELATION_PARAPHRASES: dict[str, str] = {
    "left of": "to the left of",
    "right of": "to the right of",
    "above": "on top of",
    "below": "under",
}
DIGITS: dict[int, str] = {2: "2", 3: "3", 4: "4"}
OUT_OF_TEMPLATE_FAMILIES: tuple[str, ...] = (
    "paraphrased_position",
    "paraphrased_counting",
    "color_counting",
    "color_position",
)


def out_of_template_prompts() -> list[dict]:
    """48 prompts phrased outside the training templates, 12 per family (split "out_of_template"), each with the
    metadata the detector checks, so the same reward scores them:

        paraphrased_position  "a photo of a circle to the left of a square"   (to the right of, on top of, under)
        paraphrased_counting  "a photo of 3 triangles", "a photo of a pair of squares"
        color_counting        "a photo of two red circles"                      (a colour on counted objects)
        color_position        "a photo of a red circle left of a blue square"   (colours with a relation)

    Their words partly fall outside the tiny model's vocabulary (digits, "pair", "top", ...): what a model does
    with a wording it was never trained on is the point. No prompt text here is a training prompt's."""
    shapes, colors = list(SHAPES), list(COLORS)
    pairs = list(itertools.permutations(SHAPES, 2))  # 6 ordered pairs
    out = []
    for i, rel in enumerate(RELATIONS):  # 4 relations x 3 pairs
        for a, b in pairs[i % 2 :: 2]:
            objects = [_obj(a), _obj(b)]
            text = f"a photo of {_noun(objects[0])} {RELATION_PARAPHRASES[rel]} {_noun(objects[1])}"
            out.append(_record(text, "paraphrased_position", objects, rel))
    for s in shapes:  # 3 shapes x (3 digits + pair)
        for n, digit in DIGITS.items():
            out.append(_record(f"a photo of {digit} {PLURALS[s]}", "paraphrased_counting", [_obj(s, None, n)]))
        out.append(_record(f"a photo of a pair of {PLURALS[s]}", "paraphrased_counting", [_obj(s, None, 2)]))
    for k, (s, n) in enumerate(itertools.product(shapes, (2, 3))):  # 6 x 2 colours
        for c in (colors[k % 4], colors[(k + 2) % 4]):
            out.append(_record(f"a photo of {COUNT_WORDS[n]} {c} {PLURALS[s]}", "color_counting", [_obj(s, c, n)]))
    for k, (a, b) in enumerate(pairs):  # 6 pairs x 2 relations
        for rel in (RELATIONS[k % 4], RELATIONS[(k + 1) % 4]):
            objects = [_obj(a, colors[k % 4]), _obj(b, colors[(k + 1) % 4])]
            out.append(_record(prompt_text(objects, rel), "color_position", objects, rel))
    return out


def _record(text: str, family: str, objects: list[dict], relation: str | None = None) -> dict:
    return {
        "prompt": text,
        "family": family,
        "objects": objects,
        "relation": relation,
        "combination": combination_key(objects, relation),
        "split": "out_of_template",
    }


def validation_combinations() -> set[str]:
    """The training combinations held out for validation (the module docstring's rule)."""
    held = set()
    for family in FAMILIES:
        combos = sorted({r["combination"] for r in all_prompts() if r["family"] == family and r["split"] == "train"})
        held.update(combos[1::4])
    return held


SPLITS: tuple[str, ...] = ("train", "test", "out_of_template", "val", "train_minus_val")


def prompts_of_split(split: str) -> list[dict]:
    """The records of one split: 'train', 'test', 'out_of_template', or 'val' / 'train_minus_val' (the training
    prompts held out for validation / the rest; records marked with that split)."""
    if split == "out_of_template":
        return out_of_template_prompts()
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if split in ("val", "train_minus_val"):
        held = validation_combinations()
        return [
            {**r, "split": split}
            for r in all_prompts()
            if r["split"] == "train" and (r["combination"] in held) == (split == "val")
        ]
    return [r for r in all_prompts() if r["split"] == split]


def vocabulary() -> list[str]:
    """Every word the prompts use, sorted (what the tiny model's tokenizer must know)."""
    return sorted({w for r in all_prompts() for w in r["prompt"].split()})


def write_jsonl(records: list[dict], path: str | os.PathLike) -> None:
    """Write records one JSON object per line, atomically (tmp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.chmod(tmp, 0o644)  # mkstemp makes it private
    os.replace(tmp, path)


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read prompt records written by `write_jsonl` (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
