"""Conditioning images of a prompt (point 1 of issue 24): read from a .jsonl's `image` column relative to the file,
checked before any model loads (missing, not an image, wrong count for the family: one line naming file and line),
loaded and fitted to the model's size multiple, and carried through the rollout to the family's `_predict`, per
sample, so that recomputed log-probs still equal the recorded ones.

The rollout plumbing is checked here on `ProbeEdit`, the tiny SD3 pipeline taught to take one image per prompt (its
VAE latents added to the transformer's input), independent of any real editing family; those (flux_kontext,
qwen_image_edit, wan_i2v) get the shared guarantees in tests/test_families.py and more in
tests/test_edit_families.py."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.conditioning import check_image_counts, count_problem, fit_to_multiple, image_count, load_images
from flowrl.data import PromptFileError, load_prompts
from flowrl.families.sd3 import SD3Backend, tiny_sd3_pipeline

torch.set_num_threads(1)
SIZE = 32


def _image(path: Path, size=(40, 24), colour=(200, 30, 30)) -> Path:
    Image.new("RGB", size, colour).save(path)
    return path


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ reading


def test_image_paths_are_read_relative_to_the_jsonl_and_kept_as_absolute_lists(tmp_path):
    (tmp_path / "data" / "img").mkdir(parents=True)
    a = _image(tmp_path / "data" / "img" / "a.png")
    b = _image(tmp_path / "data" / "b.jpg")
    path = _jsonl(
        tmp_path / "data" / "edits.jsonl",
        [
            {"prompt": "make it blue", "image": "img/a.png", "family": "colour"},
            {"prompt": "put them together", "image": ["img/a.png", "b.jpg"]},
            {"prompt": "a plain prompt"},
        ],
    )
    ps = load_prompts(path)
    assert ps.metadata[0] == {"image": [str(a.resolve())], "family": "colour"}
    assert ps.metadata[1]["image"] == [str(a.resolve()), str(b.resolve())]
    assert ps.metadata[2] == {}
    assert ps.origins == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert [image_count(m, "image") for m in ps.metadata] == [1, 2, 0]


def test_an_empty_image_column_name_leaves_the_column_as_plain_metadata(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "image": "https://example.org/not-a-file.png"}])
    assert load_prompts(path, image_column="").metadata == [{"image": "https://example.org/not-a-file.png"}]


@pytest.mark.parametrize("case", ["missing", "directory", "not_an_image", "truncated", "bad_type", "empty_list"])
def test_a_bad_conditioning_image_is_one_line_naming_the_file_and_line(tmp_path, case):
    _image(tmp_path / "ok.png")
    if case == "not_an_image":
        (tmp_path / "notes.png").write_text("these are words, not pixels")
    if case == "truncated":
        data = (_image(tmp_path / "full.png", size=(64, 64))).read_bytes()
        (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "folder.png").mkdir()
    value, named = {
        "missing": ("nope.png", "nope.png"),
        "directory": ("folder.png", "folder.png"),
        "not_an_image": ("notes.png", "notes.png"),
        "truncated": ("cut.png", "cut.png"),
        "bad_type": (7, "'image' must be"),
        "empty_list": ([], "'image' must be"),
    }[case]
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "fine", "image": "ok.png"}, {"prompt": "bad", "image": value}])
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:2: ") and named in message
    if case in ("missing", "directory", "not_an_image", "truncated"):  # a metadata column named `image`, perhaps
        assert message.endswith("column 'image' is data.image_column: data.image_column='' keeps it as plain metadata")


def test_fit_to_multiple_rounds_each_side_down_and_keeps_a_fitting_image():
    im = Image.new("L", (45, 17), 100)
    fitted = fit_to_multiple(im, 16)
    assert fitted.size == (32, 16) and fitted.mode == "RGB"
    assert fit_to_multiple(Image.new("RGB", (8, 70)), 16).size == (16, 64)  # never below one multiple
    same = Image.new("RGB", (32, 48))
    assert fit_to_multiple(same, 16).size == (32, 48)


def test_load_images_fits_each_image(tmp_path):
    a, b = _image(tmp_path / "a.png", size=(50, 33)), _image(tmp_path / "b.png", size=(64, 64))
    assert [im.size for im in load_images([str(a), str(b)], 16)] == [(48, 32), (64, 64)]
    assert load_images(None, 16) == [] and len(load_images(str(a), 8)) == 1


def test_a_phone_photo_is_loaded_upright_as_its_exif_orientation_says(tmp_path):
    """A JPEG stored landscape with EXIF orientation 6 (a portrait taken on a phone: turn 90 degrees clockwise to
    view) is the portrait it shows, as diffusers' load_image gives it, not the stored sideways image."""
    import numpy as np
    from diffusers.utils import load_image

    stored = np.zeros((32, 48, 3), np.uint8)  # 48 wide, 32 high as stored
    stored[:, :16] = (255, 0, 0)  # a red left third
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to view
    file = tmp_path / "portrait.jpg"
    Image.fromarray(stored).save(file, exif=exif, quality=95)
    (upright,) = load_images(str(file), 16)
    assert upright.size == (32, 48)  # 32 wide, 48 high: the portrait
    pixels = np.asarray(upright).astype(int)
    assert pixels[:16, :, 0].mean() > 200 and pixels[32:, :, 0].mean() < 50  # the red third is on top now
    np.testing.assert_array_equal(pixels, np.asarray(load_image(str(file))).astype(int))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_opens_upright_with_the_size_it_shows(tmp_path, orientation):
    """flowrl.images.open_upright (the edit rewards' source images, offline DPO's pair images) gives the pixels
    diffusers' load_image gives, and upright_size (offline DPO's size check, from the header) that image's size,
    for each of EXIF's eight orientations (5-8 turn by a quarter: width and height swap)."""
    import numpy as np
    from diffusers.utils import load_image

    from flowrl.images import open_upright, upright_size

    stored = np.random.default_rng(orientation).integers(0, 255, (24, 40, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    file = tmp_path / "photo.png"
    Image.fromarray(stored).save(file, exif=exif)
    image = open_upright(file)
    assert image.mode == "RGB" and upright_size(file) == image.size
    assert image.size == ((24, 40) if orientation >= 5 else (40, 24))
    np.testing.assert_array_equal(np.asarray(image), np.asarray(load_image(str(file))))


# ------------------------------------------------------------------------------------------ counts


def test_count_problems_say_what_the_family_takes():
    assert count_problem(0, (0, 0), "sd3") == "" and count_problem(2, (1, 3), "edit") == ""
    assert "text-to-image" in count_problem(1, (0, 0), "sd3")
    assert "exactly 1 image per prompt, got 0" in count_problem(0, (1, 1), "kontext")
    assert "1 to 3 images per prompt, got 4" in count_problem(4, (1, 3), "qwen_edit")
    with pytest.raises(ValueError, match=r"^p.jsonl:2: kontext takes exactly 1 image"):
        check_image_counts([{"image": ["a"]}, {}], ["p.jsonl:1", "p.jsonl:2"], "image", (1, 1), "kontext")


def test_preflight_rejects_images_for_a_text_to_image_family_naming_the_line(tmp_path, monkeypatch):
    from flowrl import families
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, preflight

    def no_loading(*args, **kwargs):
        raise AssertionError("preflight loaded a model")

    monkeypatch.setattr(families, "load_image_backend", no_loading)
    _image(tmp_path / "src.png")
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a cat"}, {"prompt": "make it blue", "image": "src.png"}])
    cfg = load_config(
        None, ["model.path=tiny-sd3", f"data.train_prompts={path}", "sample.height=32", "sample.width=32"]
    )
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    assert str(info.value).startswith(f"data.train_prompts: {path}:2: sd3 is a text-to-image family")
    cfg.data.image_column = ""  # the column is then plain metadata, which a text-to-image run may carry
    preflight(cfg)


def test_a_text_run_keeps_an_image_column_as_plain_metadata(tmp_path):
    """backend=text takes no images: a JSONL `image` column that names no file is metadata, not an error."""
    from flowrl.config import load_config
    from flowrl.preflight import load_prompt_sets

    path = _jsonl(tmp_path / "q.jsonl", [{"prompt": "describe it", "image": "not a file"}])
    text = load_config(None, ["backend=text", f"data.train_prompts={path}"])
    train, _ = load_prompt_sets(text)
    assert train.metadata[0]["image"] == "not a file"
    with pytest.raises(Exception, match="does not exist"):
        load_prompt_sets(load_config(None, [f"data.train_prompts={path}"]))


# ------------------------------------------------------------------------------------------ the rollout


class ProbeEdit(SD3Backend):
    """The tiny SD3 pipeline taking one conditioning image per prompt: its VAE latents added to the input."""

    family = "probe_edit"
    condition_images = (1, 1)

    def _encode_conditions(self, images, settings, prompts=None):
        from diffusers.image_processor import VaeImageProcessor

        pixels = VaeImageProcessor(vae_scale_factor=self.pipe.vae_scale_factor).preprocess(
            [im[0] for im in images], height=settings.height, width=settings.width
        )
        vae = self.pipe.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        return {"image_latents": (latents - vae.config.shift_factor) * vae.config.scaling_factor}

    def _predict(self, x, t, cond, encodings, settings):
        return super()._predict(x + cond["image_latents"].to(x.dtype), t, cond, encodings, settings)


@pytest.fixture(scope="module")
def probe():
    return ProbeEdit(tiny_sd3_pipeline(), max_sequence_length=16)


def _sources():
    red, blue = Image.new("RGB", (SIZE, SIZE), (220, 20, 20)), Image.new("RGB", (SIZE, SIZE), (20, 20, 220))
    gradient = Image.fromarray(np.linspace(0, 255, SIZE * SIZE * 3).reshape(SIZE, SIZE, 3).astype(np.uint8))
    return red, blue, gradient


def test_the_rollout_carries_each_prompts_image_to_the_family(probe):
    red, blue, _ = _sources()
    noise = torch.randn(1, 4, SIZE // 2, SIZE // 2, generator=torch.Generator().manual_seed(0)).repeat(4, 1, 1, 1)
    kwargs = dict(num_steps=3, sde_type="ode", latents=noise, height=SIZE, width=SIZE, decode=False)
    one = probe.rollout(["make it green", "make it green"], 2, images=[[red], [blue]], **kwargs)
    assert one.conditions["image_latents"].shape[0] == 4  # per sample, prompt-major
    final = one.final_latents
    assert (final[0] - final[2]).abs().max() > 1e-3  # one prompt text, two source images: two outcomes
    again = probe.rollout(["make it green", "make it green"], 2, images=[[red], [red]], **kwargs).final_latents
    assert (again[0] - again[2]).abs().max() <= 1e-6 and (again[0] - final[0]).abs().max() <= 1e-6


def test_recomputed_log_probs_equal_the_recorded_ones_with_conditions(probe):
    red, blue, gradient = _sources()
    traj = probe.rollout(
        ["make it green", "add a square", "make it green"],
        2,
        images=[[red], [blue], [gradient]],
        num_steps=4,
        seed=3,
        height=SIZE,
        width=SIZE,
        decode=False,
        same_noise_per_group=True,
    )
    lp, _, _ = probe.step_log_prob(traj, traj.train_steps)
    assert (lp - traj.log_probs[:, traj.train_steps]).abs().max().item() <= 1e-5
    rows = [5, 0, 3]
    part = traj.select(rows)
    assert torch.equal(part.conditions["image_latents"], traj.conditions["image_latents"][rows])
    lp_part, _, _ = probe.step_log_prob(part, part.train_steps)
    assert (lp_part - traj.log_probs[rows][:, traj.train_steps]).abs().max().item() <= 1e-5


def test_cat_and_flow_prediction_keep_each_samples_condition(probe):
    from flowrl.sampling import Trajectory

    red, blue, _ = _sources()
    kwargs = dict(num_steps=2, seed=1, height=SIZE, width=SIZE, decode=False)
    a = probe.rollout(["make it green"], 1, images=[[red]], **kwargs)
    b = probe.rollout(["make it green"], 1, images=[[blue]], **kwargs)
    both = Trajectory.cat([a, b])
    assert torch.equal(
        both.conditions["image_latents"], torch.cat([a.conditions["image_latents"], b.conditions["image_latents"]])
    )
    x0 = both.final_latents[[0, 0]]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    pred = probe.flow_prediction(x0, noise, 0.5, both.prompt_ids, both.prompt_encodings, both.sampler, both.conditions)
    assert (pred.velocity[0] - pred.velocity[1]).abs().max() > 1e-4  # same input, different source image


def test_a_wrong_image_count_is_an_error_before_sampling(probe):
    red, _, _ = _sources()
    with pytest.raises(ValueError, match="images of prompt 1: probe_edit takes exactly 1 image per prompt, got 0"):
        probe.rollout(["a", "b"], 1, images=[[red], []], num_steps=2, height=SIZE, width=SIZE)
    with pytest.raises(ValueError, match="probe_edit takes exactly 1 image per prompt, got 0"):
        probe.rollout(["a"], 1, num_steps=2, height=SIZE, width=SIZE)  # no images at all
    t2i = SD3Backend(probe.pipe, max_sequence_length=16)
    with pytest.raises(ValueError, match="sd3 is a text-to-image family"):
        t2i.rollout(["a"], 1, images=[[red]], num_steps=2, height=SIZE, width=SIZE)


def test_the_policy_loads_the_rows_images_and_trains_on_them_at_ratio_one(tmp_path):
    from flowrl.config import load_config
    from flowrl.policies.image import ImagePolicy

    cfg = load_config(
        None,
        [
            "model.path=tiny-sd3",
            "sample.height=32",
            "sample.width=32",
            "sample.num_steps=3",
            "sample.max_sequence_length=16",
            "sample.group_size=2",
            "model.device=cpu",
        ],
    )
    policy = ImagePolicy(cfg, "cpu")
    policy.backend = ProbeEdit(policy.backend.pipe, max_sequence_length=16)  # the same pipeline (and LoRA)
    red = _image(tmp_path / "red.png", size=(40, 40), colour=(220, 20, 20))  # fitted to 32 x 32
    blue = _image(tmp_path / "blue.png", size=(32, 32), colour=(20, 20, 220))
    meta = [{"image": [str(red)]}] * 2 + [{"image": [str(blue)]}] * 2
    batch = policy.rollout(["make it green"] * 4, meta, epoch=0, generator=torch.Generator().manual_seed(0))
    latents = batch.traj.conditions["image_latents"]
    assert latents.shape[0] == 4 and torch.equal(latents[0], latents[1]) and not torch.equal(latents[1], latents[2])
    out = policy.unit_log_probs(batch, torch.arange(4), batch.traj.train_steps[:2], with_reference=False)
    assert (out.log_prob - out.old_log_prob).abs().max().item() <= 1e-5
