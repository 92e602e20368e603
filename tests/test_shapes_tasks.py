"""The shapes world's editing and moving-shapes tasks (issue 24, point 5): the shipped data is what the script
writes, the exact rewards score the renderer's correct edits and clips 1 and hand-made wrong ones less, and the
tiny Wan preset trains end to end and writes a playable animation."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.data import load_prompts
from flowrl.worlds.shapes import COLORS, SHAPES, ShapeObject, detect_objects, draw, load_jsonl
from flowrl.worlds.shapes.edit import all_edits, apply_edit, edit_records, instruction, sample_source, split_of_edit
from flowrl.worlds.shapes.motion import DIRECTIONS, motion_prompts, render_motion
from rewards.registry import RewardError, build

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
EDIT = ROOT / "samples" / "shapes" / "edit"
MOTION = ROOT / "samples" / "shapes" / "motion"


# ---------------------------------------------------------------------------- the edit task's data


def test_the_shipped_edit_data_is_what_the_script_writes(tmp_path):
    from repo_files import load_module

    script = load_module("scripts/make_shapes_tasks.py", "make_shapes_tasks")
    counts = script.write_edit_task(tmp_path, per_instruction=4, seed=0)
    for split in ("train", "test"):
        assert (tmp_path / "edit" / f"{split}.jsonl").read_text() == (EDIT / f"{split}.jsonl").read_text()
        assert counts[split] == len(load_jsonl(EDIT / f"{split}.jsonl"))
    shipped = sorted(p.name for p in (EDIT / "images").glob("*.png"))
    assert shipped == sorted(p.name for p in (tmp_path / "edit" / "images").glob("*.png"))
    for name in shipped:
        with Image.open(EDIT / "images" / name) as a, Image.open(tmp_path / "edit" / "images" / name) as b:
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
    assert sum(p.stat().st_size for p in EDIT.rglob("*") if p.is_file()) < 300_000


def test_edit_splits_hold_out_whole_instructions_and_train_sees_every_part():
    train = {instruction(e) for e in all_edits() if split_of_edit(e) == "train"}
    test = {instruction(e) for e in all_edits() if split_of_edit(e) == "test"}
    assert train and test and not train & test
    rows = {split: load_jsonl(EDIT / f"{split}.jsonl") for split in ("train", "test")}
    assert {r["prompt"] for r in rows["train"]} == train and {r["prompt"] for r in rows["test"]} == test
    seen = {(r["edit"]["op"], r["edit"]["shape"]) for r in rows["train"]}
    assert seen == {(op, s) for op in ("recolor", "add", "remove") for s in SHAPES}
    assert {r["edit"]["color"] for r in rows["train"] if r["edit"]["op"] == "recolor"} == set(COLORS)


def test_every_source_image_loads_and_fits_its_instruction():
    """Through the data loader (image paths checked and made absolute): the instruction's shape is there once with
    another colour (recolor, remove) or absent (add), and the scene's shapes are distinct."""
    for split in ("train", "test"):
        prompts = load_prompts(EDIT / f"{split}.jsonl")
        for prompt, meta in zip(prompts.prompts, prompts.metadata):
            [path] = meta["image"]
            assert Path(path).is_absolute()
            [found] = detect_objects([Image.open(path)])
            shapes = [d.shape for d in found]
            edit = meta["edit"]
            assert len(shapes) == len(set(shapes)) >= 1 and None not in shapes, (prompt, found)
            if edit["op"] == "add":
                assert edit["shape"] not in shapes
            else:
                [target] = [d for d in found if d.shape == edit["shape"]]
                assert edit["op"] == "remove" or target.color != edit["color"]


# ---------------------------------------------------------------------------- the shapes_edit reward


def _reward(**options):
    return build("shapes_edit", options, "image")


def _source_and_paths(tmp_path, scenes):
    paths = []
    for i, scene in enumerate(scenes):
        path = tmp_path / f"source{i}.png"
        Image.fromarray(draw(scene)).save(path)
        paths.append([str(path)])
    return paths


def test_correct_edits_of_the_shipped_records_score_1():
    """The renderer's correct edit (apply_edit) of every shipped test source scores 1, through the built reward and
    the columns the data loader gives."""
    prompts = load_prompts(EDIT / "test.jsonl")
    made = edit_records("test", per_instruction=4, seed=0)  # the shipped rows' scenes, as the script drew them
    assert [r["prompt"] for r, _ in made] == prompts.prompts
    rng = np.random.default_rng(0)
    edited = [
        Image.fromarray(draw(apply_edit(scene, meta["edit"], rng))) for (_, scene), meta in zip(made, prompts.metadata)
    ]
    columns = {k: [m[k] for m in prompts.metadata] for k in prompts.metadata[0]}
    reward = _reward()
    scores = reward(edited, prompts.prompts, **columns)
    assert scores.tolist() == [1.0] * len(edited)
    assert reward.last_components["strict"].sum().item() == len(edited)


SCENE = [ShapeObject("circle", "red", 8, 8, 16), ShapeObject("square", "green", 40, 40, 12)]


@pytest.mark.parametrize(
    "edit,after,expected",
    [
        # recolor the circle blue: right / wrong colour / right but the square moved one grid step / nothing done
        (
            {"op": "recolor", "shape": "circle", "color": "blue"},
            [ShapeObject("circle", "blue", 8, 8, 16), SCENE[1]],
            1.0,
        ),
        (
            {"op": "recolor", "shape": "circle", "color": "blue"},
            [ShapeObject("circle", "yellow", 8, 8, 16), SCENE[1]],
            2 / 3,
        ),
        (
            {"op": "recolor", "shape": "circle", "color": "blue"},
            [ShapeObject("circle", "blue", 8, 8, 16), ShapeObject("square", "green", 44, 40, 12)],
            2 / 3,
        ),
        ({"op": "recolor", "shape": "circle", "color": "blue"}, SCENE, 2 / 3),
        # remove the circle: right / the square removed instead
        ({"op": "remove", "shape": "circle", "color": None}, [SCENE[1]], 1.0),
        ({"op": "remove", "shape": "circle", "color": None}, [SCENE[0]], 1 / 3),
        # add a yellow triangle: right / two of them / a red one
        (
            {"op": "add", "shape": "triangle", "color": "yellow"},
            [*SCENE, ShapeObject("triangle", "yellow", 8, 40, 16)],
            1.0,
        ),
        (
            {"op": "add", "shape": "triangle", "color": "yellow"},
            [*SCENE, ShapeObject("triangle", "yellow", 8, 40, 16), ShapeObject("triangle", "yellow", 40, 8, 12)],
            0.5,
        ),
        (
            {"op": "add", "shape": "triangle", "color": "yellow"},
            [*SCENE, ShapeObject("triangle", "red", 8, 40, 16)],
            0.75,
        ),
    ],
)
def test_shapes_edit_scores_hand_made_edits(tmp_path, edit, after, expected):
    paths = _source_and_paths(tmp_path, [SCENE])
    reward = _reward()
    score = reward([Image.fromarray(draw(after))], [instruction(edit)], edit=[edit], image=paths).item()
    assert score == pytest.approx(expected)
    assert reward.last_components["strict"].item() == float(expected == 1.0)


def test_shapes_edit_compares_places_in_fractions_of_the_image(tmp_path):
    """A correct edit at twice the source's resolution still scores 1; moved by a fifth of the image it does not."""
    edit = {"op": "recolor", "shape": "circle", "color": "blue"}
    paths = _source_and_paths(tmp_path, [SCENE, SCENE])
    right = Image.fromarray(draw([ShapeObject("circle", "blue", 8, 8, 16), SCENE[1]])).resize((128, 128), Image.NEAREST)
    moved = Image.fromarray(draw([ShapeObject("circle", "blue", 20, 8, 16), SCENE[1]])).resize(
        (128, 128), Image.NEAREST
    )
    scores = _reward(score="strict")([right, moved], ["p", "p"], edit=[edit, edit], image=paths)
    assert scores.tolist() == [1.0, 0.0]


def test_shapes_edit_names_missing_columns_and_bad_options():
    with pytest.raises(RewardError, match="needs each prompt's `edit` column and its source image in the 'image'"):
        _reward()([Image.new("RGB", (64, 64))], ["p"], edit=[{"op": "remove", "shape": "circle"}])
    with pytest.raises(ValueError, match="score must be 'fraction'"):
        _reward(score="mean")


def test_sources_and_correct_edits_are_deterministic():
    edit = {"op": "add", "shape": "square", "color": None}
    a = sample_source(edit, np.random.default_rng(3))
    assert a == sample_source(edit, np.random.default_rng(3)) and all(o.shape != "square" for o in a)
    assert [r for r, _ in edit_records("test", 1)] == [r for r, _ in edit_records("test", 1)]


# ---------------------------------------------------------------------------- the moving-shapes task


def test_the_shipped_motion_prompts_are_the_modules_and_train_sees_every_part():
    for split in ("train", "test"):
        assert load_jsonl(MOTION / f"{split}.jsonl") == motion_prompts(split)
    train = motion_prompts("train")
    assert {r["objects"][0]["shape"] for r in train} == set(SHAPES)
    assert {r["objects"][0]["color"] for r in train} == {None, *COLORS}
    assert {r["motion"] for r in train} == set(DIRECTIONS)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in motion_prompts("test")}


def _motion(**options):
    return build("shapes_motion", options, "image")


def test_rendered_clips_of_every_prompt_score_1():
    records = motion_prompts()
    rng = np.random.default_rng(0)
    videos = [render_motion(r, rng, num_frames=5 + 4 * (i % 2)) for i, r in enumerate(records)]
    reward = _motion()
    scores = reward(
        videos,
        [r["prompt"] for r in records],
        objects=[r["objects"] for r in records],
        motion=[r["motion"] for r in records],
    )
    assert scores.tolist() == [1.0] * len(records)
    assert reward.last_components["strict"].tolist() == [1.0] * len(records)


def test_shapes_motion_scores_wrong_clips_less():
    record = {
        "prompt": "a red circle moving left to right",
        "objects": [{"shape": "circle", "color": "red", "count": 1}],
        "motion": "left to right",
    }
    right = render_motion(record, np.random.default_rng(1), num_frames=5)
    backwards = right[::-1]
    still = np.repeat(right[2:3], 5, axis=0)
    blue = render_motion(
        {**record, "objects": [{"shape": "circle", "color": "blue", "count": 1}]},
        np.random.default_rng(1),
        num_frames=5,
    )
    gap = right.copy()
    gap[2] = draw([])  # the object vanishes in the middle frame
    clips = [right, backwards, still, blue, gap]
    reward = _motion()
    scores = reward(clips, [record["prompt"]] * 5, objects=[record["objects"]] * 5, motion=[record["motion"]] * 5)
    assert scores.tolist() == pytest.approx([1.0, 1 / 3, 2 / 3, 0.0, (0.8 + 0.5 + 1.0) / 3])
    components = reward.last_components
    assert components["presence"].tolist() == pytest.approx([1, 1, 1, 0, 0.8])
    assert components["monotonic"].tolist() == pytest.approx([1, 0, 1, 0, 0.5])
    assert components["travel"].tolist() == pytest.approx([1, 0, 0, 0, 1])


def test_the_geneval_reward_scores_the_frames_of_motion_prompts():
    """The motion records carry the image prompts' `objects` and `relation`: shapes_geneval scores their clips frame
    by frame (the frames a reward samples), 1 for rendered clips, less when the colour is wrong."""
    records = motion_prompts("test")
    videos = [render_motion(r, np.random.default_rng(i)) for i, r in enumerate(records)]
    columns = {"objects": [r["objects"] for r in records], "relation": [r["relation"] for r in records]}
    reward = build("shapes_geneval", {}, "image", video_frames=3)
    assert reward(videos, [r["prompt"] for r in records], **columns).tolist() == [1.0] * len(records)
    colored = next(i for i, r in enumerate(records) if r["objects"][0]["color"])
    other = next(c for c in COLORS if c != records[colored]["objects"][0]["color"])
    wrong = render_motion(
        {**records[colored], "objects": [{**records[colored]["objects"][0], "color": other}]}, np.random.default_rng(0)
    )
    one = {k: [v[colored]] for k, v in columns.items()}
    assert reward([wrong], [records[colored]["prompt"]], **one).item() < 1


def test_shapes_motion_takes_videos_only_and_names_its_columns():
    reward = _motion()
    with pytest.raises(RewardError, match="scores videos"):
        reward([Image.new("RGB", (64, 64))], ["p"], objects=[[]], motion=["left to right"])
    with pytest.raises(RewardError, match="needs each prompt's `objects` and `motion` columns"):
        reward([np.zeros((5, 64, 64, 3), np.uint8)], ["p"])


# ---------------------------------------------------------------------------- the tiny Wan preset


def test_the_wan_tiny_preset_trains_and_writes_a_playable_animation(tmp_path, monkeypatch):
    from flowrl.cli import main

    monkeypatch.chdir(ROOT)  # the preset's prompt files are relative to the repository
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "configs/wan_tiny.yaml",
                "train.epochs=1",
                "eval.before=false",
                "log.progress=false",
                f"log.run_dir={run}",
            ]
        )
        == 0
    )
    animations = sorted(run.glob("eval-*/*.webp"))
    assert animations
    with Image.open(animations[0]) as im:
        assert im.n_frames == 5 and im.size == (32, 32)
        im.seek(4)
        assert np.asarray(im.convert("RGB")).shape == (32, 32, 3)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/shapes_motion_mean" in r for r in rows)
    assert any("reward/shapes_motion/presence_mean" in r or "reward/shapes_motion_mean" in r for r in rows)


# ---------------------------------------------------------------------------- the tiny Kontext preset


def test_the_kontext_tiny_preset_edits_the_shipped_source_images(tmp_path, monkeypatch):
    """configs/kontext_tiny.yaml: the editing task's JSONL (source images by relative path) through the tiny
    FLUX.1-Kontext pipeline: an epoch trains (the LoRA moves), the edit reward scores every sample against its
    source scene, and the eval grid is written."""
    from flowrl.config import load_config
    from flowrl.train import Trainer

    monkeypatch.chdir(ROOT)  # the preset's prompt files are relative to the repository
    run = tmp_path / "run"
    tr = Trainer(
        load_config(
            ROOT / "configs" / "kontext_tiny.yaml", ["train.epochs=1", "log.progress=false", f"log.run_dir={run}"]
        )
    )
    for p in tr.named_params.values():  # lora_B starts at zero: perturb it so the adapter's gradient is not zero
        p.data.add_(0.01 * torch.randn_like(p))
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    assert tr.policy.family == "flux_kontext"
    assert all(len(m["image"]) == 1 and Path(m["image"][0]).is_file() for m in tr.train_set.metadata)
    tr.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in rows if "policy/loss" in r)
    assert epoch["policy/ratio_first_dev"] <= 1e-4
    assert 0.0 <= epoch["reward/shapes_edit_mean"] <= 1.0
    assert any("eval/shapes_edit_mean" in r for r in rows)
    assert (run / "eval-final.png").stat().st_size > 0
    assert any((p.detach() - before[n]).abs().max() > 0 for n, p in tr.named_params.items())
