"""The feature-similarity rewards (edit consistency, temporal consistency) on tiny random-weight DINOv2 and CLIP
backbones saved to a directory and loaded through the rewards' own code; each cosine is recomputed here from the
saved model's sub-modules, not through the reward's code path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from rewardtiny import block_non_loopback, random_images, save_tiny_clip, save_tiny_dinov2

import rewards
from rewards.registry import RewardError, build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    block_non_loopback(monkeypatch)


@pytest.fixture(scope="module")
def backbones(tmp_path_factory):
    """{"dinov2": (dir, model), "clip": (dir, model)}."""
    dino, clip = tmp_path_factory.mktemp("tiny_dino"), tmp_path_factory.mktemp("tiny_clip")
    return {"dinov2": (str(dino), save_tiny_dinov2(dino)), "clip": (str(clip), save_tiny_clip(clip))}


def reference_features(kind, model, processor, images):
    """Features straight from the sub-modules: DINOv2's normed [CLS]; CLIP's projected pooled vision output."""
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        if kind == "dinov2":
            hidden = model.encoder(model.embeddings(pixels)).last_hidden_state
            return model.layernorm(hidden)[:, 0]
        return model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)


def _save(images, directory):
    """The images as PNG files in `directory`; their absolute paths, one list per image (as the loader gives)."""
    paths = []
    for i, im in enumerate(images):
        path = directory / f"src{i}.png"
        im.save(path)
        paths.append([str(path)])
    return paths


# ---------------------------------------------------------------------------- edit consistency


@pytest.mark.parametrize("kind", ["dinov2", "clip"])
def test_edit_consistency_is_the_cosine_of_the_saved_backbones_features(backbones, kind, tmp_path):
    directory, model = backbones[kind]
    reward = rewards.get("edit_consistency", model=directory, device="cpu", scale=2.0)
    sources, edited = random_images(3, (40, 32), seed=1), random_images(3, (48, 40), seed=2)
    scores = reward(edited, ["a", "b", "c"], image=_save(sources, tmp_path))
    processor = reward.encoder.processor
    expected = F.cosine_similarity(
        reference_features(kind, model, processor, edited), reference_features(kind, model, processor, sources), dim=-1
    )
    assert scores.shape == (3,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, 2.0 * expected, atol=1e-5, rtol=1e-5)


def test_an_unchanged_image_scores_1_and_a_changed_one_less(backbones, tmp_path):
    reward = rewards.get("edit_consistency", model=backbones["dinov2"][0], device="cpu")
    source = random_images(1, (32, 32), seed=3)[0]
    other = random_images(1, (32, 32), seed=4)[0]
    paths = _save([source, source], tmp_path)
    scores = reward([source, other], ["keep", "change"], image=paths)
    assert scores[0].item() == pytest.approx(1.0, abs=1e-5)
    assert scores[1].item() < scores[0].item() - 1e-3


def test_inside_the_edit_region_nothing_counts_outside_it_everything_does(backbones, tmp_path):
    """An edit confined to the record's edit_region scores 1 with the region and less without it; a change outside
    the region still costs."""
    reward = rewards.get("edit_consistency", model=backbones["dinov2"][0], device="cpu")
    source = random_images(1, (32, 32), seed=5)[0]
    inside, outside = source.copy(), source.copy()
    inside.paste((255, 0, 0), (0, 0, 16, 16))  # the top-left quarter: the region below
    outside.paste((255, 0, 0), (16, 16, 32, 32))  # the bottom-right quarter
    box = [0.0, 0.0, 0.5, 0.5]
    paths = _save([source] * 3, tmp_path)
    scores = reward([inside, inside, outside], ["p"] * 3, image=paths, edit_region=[box, None, box])
    assert scores[0].item() == pytest.approx(1.0, abs=1e-5)
    assert scores[1].item() < 1 - 1e-3 and scores[2].item() < 1 - 1e-3
    assert reward.last_components["masked"].tolist() == [1.0, 0.0, 1.0]


def test_edit_consistency_reads_the_loaders_column_through_the_built_reward(backbones, tmp_path):
    """As the trainer calls it: rewards.build(...)(images, prompts, **columns), the image column holding lists of
    absolute paths; `source_index` picks among several."""
    directory = backbones["dinov2"][0]
    source, other = random_images(2, (32, 32), seed=6)
    [[a], [b]] = _save([source, other], tmp_path)
    first = build("edit_consistency", {"model": directory, "device": "cpu"}, "image")
    second = build("edit_consistency", {"model": directory, "device": "cpu", "source_index": 1}, "image")
    columns = {"image": [[a, b]], "family": ["edit"]}
    assert first([source], ["p"], **columns).item() == pytest.approx(1.0, abs=1e-5)
    assert second([source], ["p"], **columns).item() < 1 - 1e-3


def test_edit_consistency_errors_name_what_is_missing(backbones, tmp_path):
    directory = backbones["dinov2"][0]
    reward = build("edit_consistency", {"model": directory, "device": "cpu"}, "image")
    image = random_images(1, (32, 32))[0]
    with pytest.raises(RewardError, match="needs each prompt's source image: a 'image' column"):
        reward([image], ["p"])
    [path] = _save([image], tmp_path)
    with pytest.raises(RewardError, match=r"expected \[x0, y0, x1, y1\] in fractions"):
        reward([image], ["p"], image=[path], edit_region=[[0.5, 0.0, 0.2, 1.0]])
    from transformers import ViTConfig, ViTModel

    ViTModel(
        ViTConfig(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            image_size=16,
            patch_size=8,
        )
    ).save_pretrained(str(tmp_path / "vit"))
    with pytest.raises(ValueError, match="'vit' checkpoint; the similarity rewards take one of dinov2, clip"):
        rewards.get("edit_consistency", model=str(tmp_path / "vit"), device="cpu")


def test_a_backbone_that_is_not_here_offline_fails_when_built_naming_it():
    with pytest.raises(RewardError, match="'temporal_consistency' could not be built.*no-such-org/no-such-dino"):
        build("temporal_consistency", {"model": "no-such-org/no-such-dino", "device": "cpu"}, "image")


# ---------------------------------------------------------------------------- temporal consistency


def _frames(n, seed, size=32):
    return np.stack([np.asarray(im) for im in random_images(n, (size, size), seed=seed)])  # [n, H, W, 3]


@pytest.mark.parametrize("kind", ["dinov2", "clip"])
def test_temporal_consistency_is_the_mean_cosine_of_consecutive_frames(backbones, kind):
    directory, model = backbones[kind]
    reward = rewards.get("temporal_consistency", model=directory, device="cpu")
    videos = [_frames(5, seed=7), _frames(3, seed=8)]
    scores = reward(videos, ["a", "b"])
    expected, worst = [], []
    for video in videos:
        f = reference_features(kind, model, reward.encoder.processor, [Image.fromarray(x) for x in video])
        pairs = F.cosine_similarity(f[1:], f[:-1], dim=-1)
        expected.append(pairs.mean())
        worst.append(pairs.min())
    torch.testing.assert_close(scores, torch.stack(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reward.last_components["min"], torch.stack(worst), atol=1e-5, rtol=1e-5)


def test_a_static_clip_scores_higher_than_shuffled_noise(backbones):
    """A still scene (one rendered frame, repeated) against frames of independent noise, through the built reward
    (a video-native reward gets whole clips); images are refused."""
    from flowrl.worlds.shapes import render

    reward = build("temporal_consistency", {"model": backbones["dinov2"][0], "device": "cpu"}, "image")
    scene, _ = render(
        {"objects": [{"shape": "circle", "color": "red", "count": 1}], "relation": None}, np.random.default_rng(0)
    )
    static = np.repeat(scene[None], 6, axis=0)
    noise = _frames(6, seed=9, size=64)
    scores = reward([static, noise], ["a red circle", "a red circle"])
    assert scores[0].item() == pytest.approx(1.0, abs=1e-5)
    assert scores[1].item() < scores[0].item() - 1e-3
    with pytest.raises(RewardError, match="scores videos"):
        reward([Image.fromarray(scene)], ["a red circle"])


def test_one_cut_costs_one_pair_and_stride_skips_frames(backbones):
    """Frames a a a b b: pairs (a,a) (a,a) (a,b) (b,b) -> (3 + cos(a, b)) / 4, worst cos(a, b); frames a b a b a at
    stride 2 compare only a with a."""
    reward = rewards.get("temporal_consistency", model=backbones["dinov2"][0], device="cpu")
    a, b = _frames(2, seed=10)
    cut = np.stack([a, a, a, b, b])
    score = reward([cut], ["p"]).item()
    cos_ab = reward.last_components["min"].item()
    assert cos_ab < 1 - 1e-3
    assert score == pytest.approx((3 + cos_ab) / 4, abs=1e-5)
    strided = rewards.get("temporal_consistency", model=backbones["dinov2"][0], device="cpu", stride=2)
    assert strided([np.stack([a, b, a, b, a])], ["p"]).item() == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="video 0 has 1 frame"):
        reward([a[None]], ["p"])


def test_a_correct_shapes_edit_keeps_everything_outside_the_records_edit_region(backbones):
    """The shipped edit records' `edit_region` holds what a correct recolour or removal changes: with it,
    edit_consistency scores those edits 1; without it (global), less."""
    from pathlib import Path

    from flowrl.data import load_prompts
    from flowrl.worlds.shapes import draw
    from flowrl.worlds.shapes.edit import apply_edit, edit_records

    shipped = load_prompts(Path(__file__).resolve().parents[1] / "samples" / "shapes" / "edit" / "test.jsonl")
    pairs = [
        (meta, scene)
        for meta, (_, scene) in zip(shipped.metadata, edit_records("test", 4))
        if meta["edit"]["op"] != "add"
    ][:4]
    rows = [meta for meta, _ in pairs]
    edited = [Image.fromarray(draw(apply_edit(scene, meta["edit"], np.random.default_rng(0)))) for meta, scene in pairs]
    reward = rewards.get("edit_consistency", model=backbones["dinov2"][0], device="cpu")
    columns = {"image": [m["image"] for m in rows], "edit_region": [m["edit_region"] for m in rows]}
    assert reward(edited, ["p"] * 4, **columns).tolist() == pytest.approx([1.0] * 4, abs=1e-5)
    globally = rewards.get("edit_consistency", model=backbones["dinov2"][0], device="cpu", region_column="")
    assert max(globally(edited, ["p"] * 4, **columns).tolist()) < 1 - 1e-4
