"""The shapes world: renderer, prompts and split, detector (numpy only, fast)."""

import itertools
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from flowrl.worlds.shapes import (
    COLORS,
    FAMILIES,
    RELATIONS,
    SHAPES,
    ShapeObject,
    add_distractor,
    all_prompts,
    detect_objects,
    draw,
    load_jsonl,
    prompt_text,
    prompts_of_split,
    render,
    score_images,
    split_of,
)
from flowrl.worlds.shapes.detect import label_components, relation_holds
from flowrl.worlds.shapes.render import BACKGROUND, SIDES, shape_mask

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- renderer


def test_render_is_deterministic_per_seed():
    rec = all_prompts()[-1]
    a, scene_a = render(rec, np.random.default_rng(7))
    b, scene_b = render(rec, np.random.default_rng(7))
    c, _ = render(rec, np.random.default_rng(8))
    assert a.dtype == np.uint8 and a.shape == (64, 64, 3)
    assert np.array_equal(a, b) and scene_a == scene_b
    assert not np.array_equal(a, c)


def test_shape_masks_fill_their_box_as_geometry_says():
    # disc pi/4, square 1, apex-up triangle 1/2 of the box, up to pixelisation
    side = 40
    assert shape_mask("square", side).mean() == 1.0
    assert abs(shape_mask("circle", side).mean() - np.pi / 4) < 0.01
    assert abs(shape_mask("triangle", side).mean() - 0.5) < 0.02
    tri = shape_mask("triangle", side)
    assert tri[0].sum() <= 2 and tri[-1].sum() >= side - 2  # apex at the top, base at the bottom
    with pytest.raises(ValueError, match="unknown shape"):
        shape_mask("star", 5)


def test_draw_paints_only_palette_colours_where_the_objects_are():
    scene = [ShapeObject("square", "red", 2, 3, 11), ShapeObject("circle", "blue", 30, 30, 15)]
    image = draw(scene)
    assert tuple(image[3, 2]) == COLORS["red"] and tuple(image[13, 12]) == COLORS["red"]
    assert tuple(image[14, 2]) == BACKGROUND and tuple(image[37, 37]) == COLORS["blue"]
    palette = {BACKGROUND, *COLORS.values()}
    assert {tuple(p) for p in image.reshape(-1, 3)} <= palette
    with pytest.raises(ValueError, match="does not fit"):
        draw([ShapeObject("square", "red", 60, 0, 11)])


def test_rendered_scenes_match_their_metadata():
    rng = np.random.default_rng(0)
    for rec in all_prompts():
        _, scene = render(rec, rng)
        assert len(scene) == sum(o["count"] for o in rec["objects"])
        for o in rec["objects"]:
            of_shape = [s for s in scene if s.shape == o["shape"]]
            assert len(of_shape) == o["count"]
            if o["color"]:
                assert all(s.color == o["color"] for s in of_shape)
        for a, b in itertools.combinations(scene, 2):  # never touching
            assert a.x + a.side < b.x or b.x + b.side < a.x or a.y + a.side < b.y or b.y + b.side < a.y


def test_distractor_adds_one_unmentioned_object_and_nothing_at_zero():
    records = all_prompts()
    # probability 0 draws no random number: the images of a seed are the default's
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    for rec in records[:40]:
        assert np.array_equal(render(rec, rng_a)[0], render(rec, rng_b, distractor_prob=0.0)[0])
    assert rng_a.random() == rng_b.random()
    # probability 1: the asked scene plus exactly one object, apart from the others; the detector sees it
    # as the one failure the caption causes ("extra objects"), possibly with a count the extra one changes
    rng = np.random.default_rng(0)
    images, recs, extra_shapes, extra_colors = [], [], set(), set()
    for rec in records:
        image, scene = render(rec, rng, distractor_prob=1.0)
        asked = sum(o["count"] for o in rec["objects"])
        assert len(scene) == asked + 1
        extra = scene[-1]
        extra_shapes.add(extra.shape), extra_colors.add(extra.color)
        for other in scene[:-1]:
            assert (
                extra.x + extra.side < other.x
                or other.x + other.side < extra.x
                or extra.y + extra.side < other.y
                or other.y + other.side < extra.y
            )
        images.append(image), recs.append(rec)
    strict, _, details = score_images(images, recs)
    assert strict.sum() == 0
    assert all("extra objects" in d["failures"] or "count wrong" in d["failures"] for d in details)
    assert extra_shapes == set(SHAPES) and extra_colors == set(COLORS)
    # the rate is the one asked for
    rng = np.random.default_rng(1)
    n_extra = sum(len(render(records[0], rng, distractor_prob=0.3)[1]) == 2 for _ in range(2000))
    assert abs(n_extra / 2000 - 0.3) < 0.04  # 4 binomial standard deviations
    with pytest.raises(ValueError, match="distractor_prob"):
        render(records[0], rng, distractor_prob=1.5)
    # no room: the scene comes back unchanged
    full = [ShapeObject("square", "red", x, y, 16) for x in (4, 24, 44) for y in (4, 24, 44)]
    assert add_distractor(full, rng) == full


def test_a_small_distractor_has_its_own_sides_and_is_still_an_extra_object():
    records = all_prompts()
    rng = np.random.default_rng(4)
    images, sides = [], set()
    for rec in records:
        image, scene = render(rec, rng, distractor_prob=1.0, distractor_sides=(8,))
        assert {o.side for o in scene[:-1]} <= set(SIDES)  # the asked objects are drawn as before
        sides.add(scene[-1].side)
        images.append(image)
    assert sides == {8}
    strict, _, details = score_images(images, records)
    assert strict.sum() == 0  # the detector sees every small unasked object
    assert all("extra objects" in d["failures"] or "count wrong" in d["failures"] for d in details)
    # scaled like the layout at other sizes (32 px: half), and None keeps the scene's sides
    assert render(records[0], rng, size=32, distractor_prob=1.0, distractor_sides=(8,))[1][-1].side == 4
    assert render(records[0], rng, distractor_prob=1.0)[1][-1].side in SIDES


# ----------------------------------------------------------------------------- prompts and split


def test_prompt_families_and_metadata_are_valid():
    records = all_prompts()
    counts = {f: sum(r["family"] == f for r in records) for f in FAMILIES}
    assert counts == {
        "single_object": 3,
        "two_object": 6,
        "counting": 9,
        "colors": 12,
        "position": 24,
        "color_attr": 72,
    }
    assert len({r["prompt"] for r in records}) == len(records)
    for r in records:
        assert r["prompt"] == prompt_text(r["objects"], r["relation"])
        assert r["prompt"].startswith("a photo of ")
        assert (r["relation"] is not None) == (r["family"] == "position")
        assert r["relation"] is None or r["relation"] in RELATIONS
        for o in r["objects"]:
            assert o["shape"] in SHAPES and o["color"] in (None, *COLORS) and 1 <= o["count"] <= 4
        named = [o["color"] for o in r["objects"] if o["color"]]
        assert bool(named) == (r["family"] in ("colors", "color_attr"))
    assert (
        prompt_text([{"shape": "circle", "color": "red", "count": 1}, {"shape": "square", "color": "blue", "count": 1}])
        == "a photo of a red circle and a blue square"
    )
    assert prompt_text([{"shape": "triangle", "color": None, "count": 3}]) == "a photo of three triangles"


def test_split_holds_out_whole_combinations_of_known_parts():
    train, test = prompts_of_split("train"), prompts_of_split("test")
    assert len(train) + len(test) == len(all_prompts())
    train_combos, test_combos = {r["combination"] for r in train}, {r["combination"] for r in test}
    assert not train_combos & test_combos  # a test combination is never a training prompt
    for family in FAMILIES:  # every family is tested, and trained on
        n_test = sum(r["family"] == family for r in test)
        assert 0 < n_test < sum(r["family"] == family for r in all_prompts()) / 2
    # ... while every part, and every (colour, shape) binding, occurs in training
    seen = {(o["shape"], o["color"], o["count"]) for r in train for o in r["objects"]}
    assert {s for s, _, _ in seen} == set(SHAPES)
    assert {(c, s) for s, c, _ in seen if c} == set(itertools.product(COLORS, SHAPES))
    assert {n for _, _, n in seen} == {1, 2, 3, 4}
    assert {r["relation"] for r in train if r["relation"]} == set(RELATIONS)
    # meaning-preserving rewrites land in the same split: "A left of B" is "B right of A"
    c, s = {"shape": "circle", "color": None, "count": 1}, {"shape": "square", "color": None, "count": 1}
    assert split_of([c, s], "above") == split_of([s, c], "below") == "test"
    assert split_of([c, s], "left of") == split_of([s, c], "right of") == "train"


def test_validation_split_holds_out_whole_training_combinations_of_every_family():
    train, val, rest = (prompts_of_split(s) for s in ("train", "val", "train_minus_val"))
    assert sorted(r["prompt"] for r in val + rest) == sorted(r["prompt"] for r in train)
    assert not {r["combination"] for r in val} & {r["combination"] for r in rest}
    assert {r["split"] for r in val} == {"val"} and {r["split"] for r in rest} == {"train_minus_val"}
    for family in FAMILIES:  # every family is validated on and still trained on, about a quarter held out
        combos = {r["combination"] for r in train if r["family"] == family}
        held = {r["combination"] for r in val if r["family"] == family}
        assert 0 < len(held) <= max(1, len(combos) // 3) and len(held) < len(combos)
    # what is left still holds every part and every (colour, shape) binding
    seen = {(o["shape"], o["color"], o["count"]) for r in rest for o in r["objects"]}
    assert {s for s, _, _ in seen} == set(SHAPES)
    assert {(c, s) for s, c, _ in seen if c} == set(itertools.product(COLORS, SHAPES))
    assert {n for _, _, n in seen} == {1, 2, 3, 4}
    assert {r["relation"] for r in rest if r["relation"]} == set(RELATIONS)
    with pytest.raises(ValueError, match="expected one of train, test, out_of_template, val, train_minus_val"):
        prompts_of_split("validation")


def test_shipped_prompt_files_match_the_code():
    for split in ("train", "test", "val", "train_minus_val"):
        assert load_jsonl(ROOT / f"samples/shapes/{split}.jsonl") == prompts_of_split(split)


# ----------------------------------------------------------------------------- detector


def _bfs_components(classes: np.ndarray) -> list[set]:
    """Reference: breadth-first search, 4-connectivity, one image -> list of pixel sets."""
    h, w = classes.shape
    seen, comps = np.zeros_like(classes, dtype=bool), []
    for y, x in zip(*np.nonzero(classes >= 0)):
        if seen[y, x]:
            continue
        comp, queue = set(), deque([(y, x)])
        seen[y, x] = True
        while queue:
            cy, cx = queue.popleft()
            comp.add((cy, cx))
            for ny, nx in ((cy - 1, cx), (cy + 1, cx), (cy, cx - 1), (cy, cx + 1)):
                if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and classes[ny, nx] == classes[cy, cx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        comps.append(comp)
    return comps


def test_connected_components_match_a_breadth_first_search():
    rng = np.random.default_rng(3)
    classes = rng.integers(-1, 3, size=(4, 23, 17))  # dense random classes: many odd-shaped components
    labels = label_components(classes)
    for lab, cls in zip(labels, classes):
        ours = [set(zip(*np.nonzero(lab == v))) for v in np.unique(lab[lab >= 0])]
        assert sorted(map(sorted, ours)) == sorted(map(sorted, _bfs_components(cls)))


def test_detector_is_right_on_rendered_ground_truth():
    rng = np.random.default_rng(2024)
    records = all_prompts()
    metas = [records[i] for i in rng.integers(len(records), size=600)]
    images = [render(m, rng)[0] for m in metas]
    strict, fraction, _ = score_images(images, metas)
    assert strict.mean() >= 0.99
    assert fraction.mean() >= 0.995


def _meta(objects, relation=None):
    return {"objects": [dict(shape=s, color=c, count=n) for s, c, n in objects], "relation": relation}


def test_detector_finds_shapes_colours_and_boxes():
    scene = [
        ShapeObject("triangle", "green", 5, 40, 13),
        ShapeObject("circle", "yellow", 40, 6, 12),
        ShapeObject("square", "blue", 40, 40, 11),
    ]
    (found,) = detect_objects([draw(scene)])
    got = sorted((d.shape, d.color, d.x0, d.y0, d.x1, d.y1) for d in found)
    assert got == [
        ("circle", "yellow", 40, 6, 52, 18),
        ("square", "blue", 40, 40, 51, 51),
        ("triangle", "green", 5, 40, 18, 53),
    ]


def test_detector_rejects_wrong_images():
    red_circle = _meta([("circle", "red", 1)])
    # right: one red circle; wrong colour; wrong shape; an extra object
    right = draw([ShapeObject("circle", "red", 20, 20, 15)])
    blue = draw([ShapeObject("circle", "blue", 20, 20, 15)])
    square = draw([ShapeObject("square", "red", 20, 20, 15)])
    extra = draw([ShapeObject("circle", "red", 5, 5, 15), ShapeObject("triangle", "green", 40, 40, 15)])
    strict, fraction, details = score_images([right, blue, square, extra], [red_circle] * 4)
    assert strict.tolist() == [1, 0, 0, 0]
    # clauses: exactly 1 circle / every circle is red / nothing but 1 object
    np.testing.assert_allclose(fraction, [1, 2 / 3, 1 / 3, 2 / 3], atol=1e-6)
    assert [c["ok"] for c in details[1]["clauses"]] == [True, False, True]

    # counting: three triangles asked, two or four drawn
    three = _meta([("triangle", None, 3)])
    tris = [ShapeObject("triangle", "red", x, y, 13) for x, y in ((4, 4), (40, 4), (4, 40), (40, 40))]
    strict, fraction, _ = score_images([draw(tris[:3]), draw(tris[:2]), draw(tris)], [three] * 3)
    assert strict.tolist() == [1, 0, 0]
    np.testing.assert_allclose(fraction, [1, 0, 0], atol=1e-6)

    # position: swapped relation, and an ambiguous (diagonal-dominated) layout
    left = _meta([("circle", None, 1), ("square", None, 1)], "left of")
    ok = draw([ShapeObject("circle", "red", 5, 25, 14), ShapeObject("square", "blue", 40, 27, 14)])
    swapped = draw([ShapeObject("circle", "red", 40, 25, 14), ShapeObject("square", "blue", 5, 27, 14)])
    diagonal = draw([ShapeObject("circle", "red", 5, 2, 14), ShapeObject("square", "blue", 22, 45, 14)])
    strict, fraction, _ = score_images([ok, swapped, diagonal], [left] * 3)
    assert strict.tolist() == [1, 0, 0]
    np.testing.assert_allclose(fraction, [1, 3 / 4, 3 / 4], atol=1e-6)

    # colour attribution with the colours swapped between the shapes
    attr = _meta([("circle", "red", 1), ("square", "blue", 1)])
    good = draw([ShapeObject("circle", "red", 5, 5, 14), ShapeObject("square", "blue", 40, 40, 14)])
    bad = draw([ShapeObject("circle", "blue", 5, 5, 14), ShapeObject("square", "red", 40, 40, 14)])
    strict, fraction, _ = score_images([good, bad], [attr] * 2)
    assert strict.tolist() == [1, 0]
    np.testing.assert_allclose(fraction, [1, 3 / 5], atol=1e-6)


def test_detector_ignores_specks_and_rejects_merged_blobs():
    image = draw([ShapeObject("circle", "red", 20, 20, 15)])
    image[2:5, 2:5] = COLORS["green"]  # 9 px: noise, below MIN_AREA
    (found,) = detect_objects([image])
    assert [(d.shape, d.color) for d in found] == [("circle", "red")]
    merged = draw([ShapeObject("square", "red", 10, 20, 14), ShapeObject("square", "red", 24, 20, 14)])
    (found,) = detect_objects([merged])  # one 28x14 blob: an object, but no shape
    assert [(d.shape, d.color) for d in found] == [(None, "red")]


def test_relation_rule_by_hand():
    from flowrl.worlds.shapes.detect import Detection

    a = Detection("circle", "red", 0, 20, 10, 30, 78)  # centre (5, 25), side 10
    b = Detection("square", "blue", 9, 22, 19, 32, 100)  # centre (14, 27): 9 px right, 2 px down
    assert relation_holds(a, b, "left of") and relation_holds(b, a, "right of")
    assert not relation_holds(a, b, "right of") and not relation_holds(a, b, "above")
    c = Detection("square", "blue", 4, 20, 14, 30, 100)  # centre 4 px right of a's: < 0.5 x side 10
    assert not relation_holds(a, c, "left of")
    with pytest.raises(ValueError, match="unknown relation"):
        relation_holds(a, b, "beside")


def test_diagnose_names_each_kind_of_failure():
    from flowrl.worlds.shapes import diagnose

    def why(scene, meta):
        (found,) = detect_objects([draw(scene)])
        return diagnose(found, meta)

    attr = _meta([("circle", "red", 1), ("square", "blue", 1)])
    circle, square = ShapeObject("circle", "red", 5, 5, 14), ShapeObject("square", "blue", 40, 40, 14)
    assert why([circle, square], attr) == []
    # binding: the square wears the circle's colour; an unasked colour; both shapes swapped
    assert why([circle, ShapeObject("square", "red", 40, 40, 14)], attr) == ["colour swapped"]
    assert why([circle, ShapeObject("square", "green", 40, 40, 14)], attr) == ["colour unasked"]
    assert why([ShapeObject("circle", "blue", 5, 5, 14), ShapeObject("square", "red", 40, 40, 14)], attr) == [
        "colour swapped"
    ]
    # a single coloured object: any other colour is unasked
    assert why([ShapeObject("circle", "blue", 5, 5, 14)], _meta([("circle", "red", 1)])) == ["colour unasked"]
    # a missing shape (a triangle drawn instead), and an extra object
    assert why([circle, ShapeObject("triangle", "blue", 40, 40, 14)], attr) == ["shape missing"]
    assert why([circle, square, ShapeObject("triangle", "green", 5, 40, 13)], attr) == ["extra objects"]
    # counting: two of three asked, and four of three (also one object too many)
    three = _meta([("triangle", None, 3)])
    tris = [ShapeObject("triangle", "red", x, y, 13) for x, y in ((4, 4), (40, 4), (4, 40), (40, 40))]
    assert why(tris[:2], three) == ["count wrong"]
    assert why(tris, three) == ["count wrong", "extra objects"]
    # relations: the wrong side; with the square missing, the relation is put down to the missing shape
    left = _meta([("circle", None, 1), ("square", None, 1)], "left of")
    assert why([ShapeObject("circle", "red", 40, 25, 14), ShapeObject("square", "blue", 5, 27, 14)], left) == [
        "relation wrong"
    ]
    assert why([ShapeObject("circle", "red", 5, 25, 14)], left) == ["shape missing"]


def test_diagnose_is_empty_exactly_when_strict_holds():
    from flowrl.worlds.shapes.detect import FAILURE_KINDS

    # every prompt names distinct shapes, which the object-count argument in diagnose relies on
    for r in all_prompts():
        shapes = [o["shape"] for o in r["objects"]]
        assert len(set(shapes)) == len(shapes), r["prompt"]
    # ground truths of random prompts scored against random prompts: mostly failures of every kind
    rng = np.random.default_rng(7)
    records = all_prompts()
    drawn = [records[i] for i in rng.integers(len(records), size=400)]
    asked = [records[i] if k % 3 else drawn[k] for k, i in enumerate(rng.integers(len(records), size=400))]
    strict, _, details = score_images([render(m, rng)[0] for m in drawn], asked)
    seen = set()
    for s, d in zip(strict, details):
        assert (d["failures"] == []) == bool(s), d
        assert d["failures"] == [k for k in FAILURE_KINDS if k in d["failures"]]  # each once, in order
        seen.update(d["failures"])
    assert seen == set(FAILURE_KINDS)
    assert 0.2 < strict.mean() < 0.6


def test_score_images_accepts_pil_and_float_images_and_checks_lengths():
    from PIL import Image

    meta = _meta([("square", "yellow", 1)])
    image = draw([ShapeObject("square", "yellow", 20, 20, 15)])
    strict, _, _ = score_images([Image.fromarray(image), image.astype(np.float32) / 255.0], [meta, meta])
    assert strict.tolist() == [1, 1]
    with pytest.raises(ValueError, match="one each"):
        score_images([image], [meta, meta])


def test_out_of_template_split_is_new_wording_scored_by_the_same_reward():
    """The out-of-template split (samples/shapes/out_of_template.jsonl, what `out_of_template_prompts` writes):
    48 prompts, 12 per family, none a training or test prompt's text; each family is what it says (a colour
    with a count, a colour with a relation, the paraphrased wordings); rendered ground truth passes every
    clause of the detector, so the shapes reward scores them as it scores the test split."""
    from pathlib import Path

    from flowrl.worlds.shapes.detect import score_images
    from flowrl.worlds.shapes.prompts import all_prompts, load_jsonl, out_of_template_prompts
    from flowrl.worlds.shapes.render import render

    records = out_of_template_prompts()
    shipped = load_jsonl(Path(__file__).resolve().parents[1] / "samples" / "shapes" / "out_of_template.jsonl")
    assert shipped == records
    assert len(records) == 48 and len({r["prompt"] for r in records}) == 48
    assert {r["family"]: sum(x["family"] == r["family"] for x in records) for r in records} == {
        "paraphrased_position": 12,
        "paraphrased_counting": 12,
        "color_counting": 12,
        "color_position": 12,
    }
    assert not {r["prompt"] for r in records} & {r["prompt"] for r in all_prompts()}
    for r in records:
        if r["family"] == "color_counting":
            assert r["objects"][0]["count"] > 1 and r["objects"][0]["color"] and r["relation"] is None
        if r["family"] == "color_position":
            assert all(o["color"] for o in r["objects"]) and r["relation"] is not None
    rng = np.random.default_rng(0)
    images = [render(r, rng)[0] for r in records]
    strict, _, _ = score_images(images, records)
    assert strict.tolist() == [1.0] * len(records)
