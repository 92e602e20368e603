"""Samples with a time axis (point 2 of issue 24): frames chosen evenly, rewards that declare what they score (an
image reward scores frames of a video and their mean makes the video's score; a video-native reward gets the
clip), contact sheets in eval grids, and videos written as animations Pillow reads back."""

import functools
import types

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from flowrl.images import eval_grid, image_grid
from flowrl.video import (
    aggregate,
    as_video,
    contact_sheet,
    frame_indices,
    is_video,
    mp4_available,
    sampled_frames,
    save_animation,
)
from rewards.registry import NamedReward, RewardConfigError, RewardError


def _clip(num_frames=9, size=(12, 16), seed=0):
    """A video whose frame i is filled with the grey level 20 * i (+ a little seeded noise in its last row)."""
    h, w = size
    video = np.zeros((num_frames, h, w, 3), dtype=np.uint8)
    for i in range(num_frames):
        video[i] = 20 * i
    video[:, -1] = np.random.default_rng(seed).integers(0, 255, (num_frames, w, 3), dtype=np.uint8)
    return video


def _level(image) -> int:
    """The grey level of a frame made by _clip (read off its top-left pixel)."""
    return int(np.asarray(image.convert("RGB"))[0, 0, 0])


# ------------------------------------------------------------------------------------------ frames


@pytest.mark.parametrize(
    "num_frames,k,expected",
    [(9, 3, [0, 4, 8]), (17, 4, [0, 5, 11, 16]), (5, 8, [0, 1, 2, 3, 4]), (9, 1, [0]), (2, 2, [0, 1]), (1, 4, [0])],
)
def test_frame_indices_are_even_from_first_to_last(num_frames, k, expected):
    assert frame_indices(num_frames, k) == expected


def test_frame_indices_reject_nonsense():
    with pytest.raises(ValueError):
        frame_indices(0, 2)
    with pytest.raises(ValueError):
        frame_indices(5, 0)


def test_as_video_takes_uint8_floats_and_pil_frames_and_names_a_bad_shape():
    floats = np.linspace(0, 1, 2 * 4 * 4 * 3).reshape(2, 4, 4, 3)
    video = as_video(floats)
    assert video.dtype == np.uint8 and video[0, 0, 0, 0] == 0 and video[-1, -1, -1, -1] == 255
    from_pil = as_video([Image.new("RGB", (5, 3), (i, 0, 0)) for i in range(4)])
    assert from_pil.shape == (4, 3, 5, 3) and from_pil[2, 0, 0, 0] == 2
    assert is_video(video) and not is_video(Image.new("RGB", (2, 2))) and not is_video(np.zeros((4, 4, 3)))
    with pytest.raises(ValueError, match=r"frames \[F, H, W, C\]"):
        as_video(np.zeros((4, 4, 3), dtype=np.uint8))


def test_sampled_frames_and_aggregate_work_per_video():
    videos = [_clip(9), _clip(3)]
    frames, counts = sampled_frames(videos, 3)
    assert counts == [3, 3] and [_level(f) for f in frames] == [0, 80, 160, 0, 20, 40]
    values = np.array([1.0, 2.0, 6.0, np.nan, 4.0, 8.0])
    assert aggregate(values, counts).tolist() == [3.0, 6.0]  # a NaN frame is left out
    assert aggregate(values, counts, "min").tolist() == [1.0, 4.0]
    assert aggregate(values, counts, "max").tolist() == [6.0, 8.0]
    assert np.isnan(aggregate([np.nan, np.nan], [2])[0])
    with pytest.raises(ValueError, match="unknown frame aggregate"):
        aggregate(values, counts, "median")


# ------------------------------------------------------------------------------------------ rewards


def brightness(images, prompts, scale=1.0, tag=None):
    """An image reward: each image's mean grey level, recording what it was called with."""
    brightness.calls.append((list(prompts), tag))
    values = torch.tensor([np.asarray(im.convert("L"), dtype=np.float32)[:-1].mean() for im in images])
    brightness.last_components = {"twice": 2 * values}
    return scale * values


def motion(videos, prompts):
    """A video-native reward: the mean absolute change between consecutive frames."""
    return [float(np.abs(np.diff(v.astype(np.float32), axis=0)).mean()) for v in videos]


motion.accepts = ("video",)


def test_an_image_reward_scores_evenly_chosen_frames_and_averages_them():
    brightness.calls = []
    reward = NamedReward(brightness, "brightness", "image", options={"scale": 0.5}, video_frames=3)
    videos = [_clip(9), _clip(5, seed=1)]
    scores = reward(videos, ["a", "b"], tag=["x", "y"])
    # frames 0, 4, 8 of the first (levels 0, 80, 160) and 0, 2, 4 of the second (0, 40, 80), halved
    assert torch.allclose(scores, torch.tensor([40.0, 20.0]))
    assert brightness.calls == [(["a", "a", "a", "b", "b", "b"], ["x", "x", "x", "y", "y", "y"])]
    assert torch.allclose(reward.last_components["twice"], torch.tensor([160.0, 80.0]))
    lowest = NamedReward(brightness, "brightness", "image", video_frames=2, video_aggregate="min")
    assert torch.allclose(lowest(videos, ["a", "b"]), torch.tensor([0.0, 0.0]))
    images = [Image.new("RGB", (4, 4), (30, 30, 30))]
    assert torch.allclose(reward(images, ["c"]), torch.tensor([15.0]))  # images: as before
    assert torch.allclose(reward.last_components["twice"], torch.tensor([60.0]))  # that call's components


def test_a_video_native_reward_gets_whole_clips_and_refuses_images():
    reward = NamedReward(motion, "motion", "image", video_frames=2)
    assert reward.accepts == ("video",)
    still, moving = np.repeat(_clip(1), 5, axis=0), _clip(5)
    scores = reward([still, moving], ["a", "b"])
    assert scores[0] == 0.0 and scores[1] > 10.0  # frames 1, 2, 3 matter: not a sample of two
    with pytest.raises(RewardError, match="scores videos .* only; this model makes images"):
        reward([Image.new("RGB", (4, 4))], ["a"])
    with pytest.raises(RewardError, match="both images and videos"):
        NamedReward(brightness, "b", "image")([moving, Image.new("RGB", (16, 12))], ["a", "b"])


def test_a_registered_image_reward_scores_videos_through_build():
    reward = rewards.build("jpeg_compressibility", {}, "image", video_frames=3)
    videos = [_clip(9, size=(32, 32)), _clip(7, size=(32, 32), seed=3)]
    expected = []
    for video in videos:
        per_frame = reward([Image.fromarray(video[i]) for i in frame_indices(len(video), 3)], ["p"] * 3)
        expected.append(per_frame.mean())
    assert torch.allclose(reward(videos, ["p", "q"]), torch.stack(expected))
    assert reward.last_components["jpeg_kb"].shape == (2,)


def test_a_registered_video_reward_carries_its_declaration(monkeypatch):
    from rewards import registry

    registry.load_all()
    monkeypatch.setattr(registry.REWARDS, "_items", dict(registry.REWARDS._items))  # registered for this test only

    class Motion:
        def __call__(self, videos, prompts):
            return motion(videos, prompts)

    registry.register("test_motion", kind="image", accepts=("video",))(Motion)
    assert registry.declared_accepts("test_motion") == ("video",)
    assert registry.declared_accepts("jpeg_compressibility") == ("image",)
    built = rewards.build("test_motion", {}, "image", video_frames=2)
    assert built.accepts == ("video",)
    assert built([_clip(5)], ["a"]).item() == pytest.approx(motion([_clip(5)], ["a"])[0])  # the clip, not 2 frames


def test_bad_video_settings_and_declarations_are_config_errors():
    with pytest.raises(RewardConfigError, match="video_frames must be >= 1"):
        rewards.build("jpeg_compressibility", {}, "image", video_frames=0)
    with pytest.raises(ValueError, match="accepts must be"):
        rewards.register("never_registered", kind="image", accepts=("audio",))


def test_the_config_carries_the_frame_knobs_to_the_built_rewards():
    from flowrl.config import ConfigError, load_config
    from flowrl.train.scoring import build_reward_fns

    cfg = load_config(None, ["rewards.0.video_frames=6", "rewards.0.video_aggregate=min"])
    (built,) = build_reward_fns(cfg, "image")
    assert built.video_frames == 6 and built.video_aggregate == "min"
    with pytest.raises(ConfigError, match="video_frames"):
        load_config(None, ["rewards.0.video_frames=0"])


def test_preflight_refuses_a_video_only_reward_for_an_image_model(tmp_path, monkeypatch):
    from flowrl import families
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, preflight

    monkeypatch.setattr(families, "load_image_backend", lambda *a, **k: pytest.fail("preflight loaded a model"))
    plugin = tmp_path / "clips.py"
    plugin.write_text("def motion(videos, prompts):\n    return [0.0] * len(videos)\n\n\nmotion.accepts = ('video',)\n")
    image_run = ["model.path=tiny-sd3", "sample.height=32", "sample.width=32", f"rewards.0.name={plugin}:motion"]
    with pytest.raises(PreflightError, match=r"rewards\[0\] \(.*clips.py:motion\) scores videos only .* sd3 makes"):
        preflight(load_config(None, image_run))
    video_run = ["model.path=tiny-wan", "sample.height=32", "sample.width=32", "sample.num_frames=5"]
    preflight(load_config(None, [*video_run, f"rewards.0.name={plugin}:motion"]))
    preflight(load_config(None, [*video_run, "rewards.0.name=jpeg_compressibility"]))  # frames of each video


# ------------------------------------------------------------------------------------------ outputs


def test_a_contact_sheet_shows_the_first_middle_and_last_frames():
    video = _clip(9, size=(12, 16))
    sheet = contact_sheet(video, pad=2)
    assert sheet.size == (3 * 16 + 2 * 2, 12)
    assert [_level(sheet.crop((x, 0, x + 16, 12))) for x in (0, 18, 36)] == [0, 80, 160]
    assert contact_sheet(_clip(1)).size == (16, 12)


def test_an_eval_grid_of_videos_is_the_grid_of_their_contact_sheets():
    videos = [_clip(5, seed=s) for s in range(4)]
    grid = eval_grid(videos, ["a", "b"], scores=[0.1, 0.2, 0.3, 0.4])
    sheets = eval_grid([contact_sheet(v) for v in videos], ["a", "b"], scores=[0.1, 0.2, 0.3, 0.4])
    assert np.array_equal(np.asarray(grid), np.asarray(sheets))
    assert image_grid([contact_sheet(v) for v in videos], cols=2).size[0] == 2 * (3 * 16 + 2) + 3 * 2


@pytest.mark.parametrize("suffix", [".webp", ".gif"])
def test_a_video_is_written_as_an_animation_pillow_reads_back(tmp_path, suffix):
    video = _clip(6, size=(8, 10))
    path = save_animation(video, tmp_path / f"clip{suffix}", fps=5)
    assert path.exists() and not list(tmp_path.glob("*.tmp*"))
    with Image.open(path) as im:
        assert im.n_frames == 6 and im.info.get("loop") == 0
        levels, durations = [], []
        for i in range(6):
            im.seek(i)
            im.load()
            levels.append(_level(im))
            durations.append(im.info.get("duration"))
    assert levels == [20 * i for i in range(6)] and durations == [200] * 6


def test_mp4_is_written_only_with_imageio_ffmpeg(tmp_path):
    video = _clip(4, size=(16, 16))
    if mp4_available():
        assert save_animation(video, tmp_path / "clip.mp4").stat().st_size > 0
    else:
        with pytest.raises(ImportError, match=r"imageio\[ffmpeg\]"):
            save_animation(video, tmp_path / "clip.mp4")
    with pytest.raises(ValueError, match="valid: .webp, .gif, .mp4"):
        save_animation(video, tmp_path / "clip.avi")


def test_the_policys_eval_writer_draws_contact_sheets_and_writes_the_videos(tmp_path):
    from flowrl.config import load_config
    from flowrl.policies.image import ImagePolicy

    owner = types.SimpleNamespace(cfg=load_config(None, ["eval.video_format=gif", "eval.fps=4"]))
    owner.save_sample = functools.partial(ImagePolicy.save_sample, owner)
    videos = [_clip(5, seed=s) for s in range(2)]
    path = ImagePolicy.save_eval_outputs(owner, videos, ["a moving square"], tmp_path / "eval-000001", [1.0, 2.0])
    assert path == tmp_path / "eval-000001.png"
    expected = eval_grid([contact_sheet(v) for v in videos], ["a moving square"], [1.0, 2.0])
    assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), np.asarray(expected))
    written = sorted(p.name for p in (tmp_path / "eval-000001").iterdir())
    assert written == ["000.gif", "001.gif"]
    with Image.open(tmp_path / "eval-000001" / "001.gif") as im:
        assert im.n_frames == 5 and im.info["duration"] == 250
    image = ImagePolicy.save_sample(owner, Image.new("RGB", (4, 4)), tmp_path / "one")
    assert image.name == "one.png" and image.exists()
