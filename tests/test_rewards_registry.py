"""The reward registry, the JPEG rewards and the weighted sum."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from rewardtiny import random_images

import rewards
import rewards.registry as registry

EXPECTED = {
    "accuracy",
    "aesthetic",
    "clip_score",
    "hpsv2",
    "imagereward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "ocr",
    "pickscore",
    "remote",
    "soft_overlong",
    "think_format",
    "weighted",
}


def test_available_lists_every_reward_and_filters_by_kind():
    assert EXPECTED <= set(rewards.available())
    assert {"accuracy", "soft_overlong", "think_format"} <= set(rewards.available("text"))
    assert not {"accuracy", "think_format"} & set(rewards.available("image"))
    with pytest.raises(ValueError, match="kind must be one of"):
        rewards.available("audio")


def test_unknown_name_and_option_list_the_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown reward 'pickscor'\. Did you mean 'pickscore'.*Valid: accuracy.*, weighted; or a plug-in "
        r"'package\.module:function' or 'path/to/file\.py:function'\.$",
    ):
        rewards.get("pickscor")  # (as `flowrl serve-reward pickscor` says it)
    with pytest.raises(
        TypeError, match=r"unknown option\(s\) 'qualty'\. Did you mean 'quality'\? Valid options: quality"
    ):
        rewards.get("jpeg_incompressibility", qualty=90)


def test_register_a_new_reward_as_documented(monkeypatch):
    monkeypatch.setattr(registry.REWARDS, "_items", dict(registry.REWARDS._items))  # undone after the test

    @rewards.register("brightness_for_test", kind=rewards.IMAGE, memory=rewards.NOTHING)
    def brightness(gain: float = 1.0):
        return lambda images, prompts, **metadata: torch.tensor(
            [gain * np.asarray(x.convert("L"), dtype=np.float64).mean() / 255 for x in images]
        )

    reward = rewards.get("brightness_for_test", gain=2.0)
    assert reward.kind == "image" and reward.__name__ == "<lambda>"
    white = Image.new("RGB", (4, 4), "white")
    assert reward([white], ["p"]).tolist() == [2.0]  # gain 2 * mean luminance 1
    assert "brightness_for_test" in rewards.available("image")
    assert rewards.memory_spec("brightness_for_test") == []  # nothing on the accelerator, as declared
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("brightness_for_test", kind="image")(brightness)
    with pytest.raises(ValueError, match="kind must be one of"):
        rewards.register("x", kind="video")


def test_kind_of():
    assert rewards.kind_of(rewards.get("think_format")) == "text"
    trl_style = lambda prompts, completions, **kw: [0.0] * len(completions)  # noqa: E731
    assert rewards.kind_of(trl_style, default="text") == "text"
    with pytest.raises(ValueError, match="has no kind"):
        rewards.kind_of(trl_style)


def test_import_and_listing_load_no_model_library():
    code = (
        "import sys, rewards; rewards.available(); "
        "print(sorted(m for m in ('transformers', 'open_clip', 'pytesseract', 'ImageReward', 'paddleocr') "
        "if m in sys.modules))"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_jpeg_size_in_kb_at_quality_95(tmp_path):
    images = random_images(2, (48, 32), seed=10) + [Image.new("RGB", (48, 32), (120, 30, 200))]
    sizes = []
    for i, image in enumerate(images):  # the file on disk, 1 kB = 1000 bytes
        image.save(tmp_path / f"{i}.jpg", format="JPEG", quality=95)
        sizes.append(os.path.getsize(tmp_path / f"{i}.jpg") / 1000)
    incompressibility = rewards.get("jpeg_incompressibility")(images, ["p"] * 3)
    compressibility = rewards.get("jpeg_compressibility")(images, ["p"] * 3)
    torch.testing.assert_close(incompressibility, torch.tensor(sizes, dtype=torch.float32))
    torch.testing.assert_close(compressibility, -torch.tensor(sizes, dtype=torch.float32))
    assert compressibility[2] > compressibility[0]  # a flat image compresses better than noise
    assert incompressibility.dtype == torch.float32


def test_image_reward_input_checks():
    reward = rewards.get("jpeg_compressibility")
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(random_images(2), ["p"])
    with pytest.raises(TypeError, match="list of PIL images.*Tensor"):
        reward([torch.zeros(3, 8, 8)], ["p"])


def test_weighted_image_sum_keeps_components():
    images = random_images(2, (32, 32), seed=11) + [Image.new("RGB", (32, 32), "gray")]
    reward = rewards.get(
        "weighted",
        components={
            "jpeg_incompressibility": 2.0,
            "small": {"reward": "jpeg_compressibility", "weight": 0.5, "quality": 50},
        },
    )
    total = reward(images, ["p"] * 3)
    big = rewards.get("jpeg_incompressibility")(images, ["p"] * 3)
    small = rewards.get("jpeg_compressibility", quality=50)(images, ["p"] * 3)
    torch.testing.assert_close(total, 2.0 * big + 0.5 * small)
    torch.testing.assert_close(reward.last_components["jpeg_incompressibility"], big)
    torch.testing.assert_close(reward.last_components["small"], small)
    torch.testing.assert_close(reward.last_components["small/jpeg_kb"], -small)
    assert reward.kind == "image"


def test_weighted_text_sum_skips_none_like_trl():
    reward = rewards.get("weighted", components={"accuracy": 1.0, "think_format": 0.25})
    completions = ["<think>r</think><answer>4</answer>", "4", "<think>r</think><answer>x</answer>"]
    # accuracy [1, 1, None]; think_format [1, 0, 1] -> [1 + 0.25, 1 + 0, 0.25]
    assert reward(["q"] * 3, completions, solution=["4", "4", "pi"]) == [1.25, 1.0, 0.25]
    assert reward.last_components["accuracy"] == [1.0, 1.0, None]
    assert reward.kind == "text"
    only_none = rewards.combine({"acc": rewards.get("accuracy")})
    assert only_none(["q"], ["1"], solution=["pi"]) == [None]


def test_weighted_rejects_mixed_kinds_and_bad_specs():
    with pytest.raises(ValueError, match="mixes kinds"):
        rewards.get("weighted", components={"accuracy": 1.0, "jpeg_compressibility": 1.0})
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        rewards.get("weighted", components={"nope": 1.0})
    with pytest.raises(ValueError, match="at least one|needs components"):
        rewards.get("weighted", components={})
    with pytest.raises(ValueError, match="same rewards"):
        rewards.combine({"a": rewards.get("accuracy")}, {"b": 1.0})


def test_check_validates_registered_names_options_and_kind_without_building(monkeypatch):
    monkeypatch.setattr(registry.REWARDS, "_items", dict(registry.REWARDS._items))  # undone after the test
    built = []

    @rewards.register("heavy_for_test", kind=rewards.IMAGE)
    def heavy(model: str, scale: float = 1.0):
        built.append(model)  # stands for loading weights
        return lambda images, prompts, **metadata: torch.full((len(images),), scale)

    rewards.check("heavy_for_test", {"model": "some/weights", "scale": 2.0}, "image")
    assert built == []  # nothing was built
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'heavy_for_test' got unknown option\(s\) 'scael'\. "
        r"Did you mean 'scale'\? Valid options: model, scale\.$",
    ):
        rewards.check("heavy_for_test", {"model": "m", "scael": 2.0}, "image")
    with pytest.raises(rewards.RewardConfigError, match=r"'heavy_for_test' needs option\(s\) 'model' in its kwargs"):
        rewards.check("heavy_for_test", {}, "image")
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'heavy_for_test' is an image reward; this backend needs "
        r"text rewards: accuracy, calc_answer, soft_overlong, think_format, tool_used, or a plug-in",
    ):
        rewards.check("heavy_for_test", {"model": "m"}, "text")
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^unknown reward 'heavy_for_tset'\. Did you mean "
        r"'heavy_for_test'\? Valid image rewards: aesthetic, .*"
        r"heavy_for_test.*; or a plug-in 'package.module:function'",
    ):
        rewards.check("heavy_for_tset", {}, "image")
    reward = rewards.build("heavy_for_test", {"model": "m", "scale": 2.0}, "image")
    assert built == ["m"] and reward.kind == "image" and reward.__name__ == "heavy_for_test"
    assert reward(random_images(2), ["a", "b"]).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="kind must be one of"):
        rewards.check("accuracy", {}, "audio")


def test_check_follows_remote_and_weighted_options_to_their_kind():
    rewards.check("remote", {"url": "http://127.0.0.1:9", "kind": "text"}, "text")
    with pytest.raises(
        rewards.RewardConfigError, match=r"'remote' is a text reward \(kwargs\.kind: text\); this backend needs image"
    ):
        rewards.check("remote", {"url": "http://127.0.0.1:9", "kind": "text"}, "image")
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'remote': remote reward url must look like "
        r"http://HOST:PORT, got 'localhost'$",
    ):
        rewards.check("remote", {"url": "localhost"}, "image")
    rewards.check("weighted", {"components": {"accuracy": 1.0, "format": {"reward": "think_format"}}}, "text")
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^weighted component 'small': reward 'jpeg_compressibility' "
        r"is an image reward; this backend needs text rewards",
    ):
        rewards.check(
            "weighted", {"components": {"accuracy": 1.0, "small": {"reward": "jpeg_compressibility"}}}, "text"
        )
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"weighted component 'jpeg_compressibility': .*unknown "
        r"option\(s\) 'qualty'",
    ):
        rewards.check("weighted", {"components": {"jpeg_compressibility": {"qualty": 3}}}, "image")


def test_a_failing_registered_reward_is_named_and_a_bad_value_is_a_config_error():
    reward = rewards.build("accuracy", {}, "text")
    with pytest.raises(
        rewards.RewardError, match=r"^reward 'accuracy' failed: KeyError: .*'solution' or 'answer'"
    ) as info:
        reward(["q"], ["1"], label=["1"])
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'soft_overlong' needs 0 < cache_length",  # (its check_options)
    ):
        rewards.build("soft_overlong", {"max_length": 4, "cache_length": 8}, "text")
    with pytest.raises(rewards.RewardConfigError, match=r"^reward 'jpeg_compressibility': JPEG quality must be in"):
        rewards.build("jpeg_compressibility", {"quality": 500}, "image")  # a factory's ValueError, named


def _cache(monkeypatch, tmp_path, *repos):
    """An empty Hugging Face cache at tmp_path/hub holding a snapshot of each of `repos`."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for repo in repos:
        (tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123").mkdir(parents=True)


def test_weights_a_reward_names_are_found_in_its_options_and_defaults(tmp_path):
    from rewards.registry import weight_sources

    assert weight_sources("pickscore", {}) == {
        "model": "yuvalkirstain/PickScore_v1",
        "processor": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    }
    local = tmp_path / "pick"
    local.mkdir()
    # a local directory given, the default processor kept; device and dtype are never weights
    assert weight_sources("pickscore", {"model": str(local), "device": "cpu"}) == {
        "model": str(local),
        "processor": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    }
    assert weight_sources("shapes_geneval", {"score": "strict"}) == {}  # no weights
    assert weight_sources("my_scores.py:brightness", {}) == {}  # a plug-in says nothing


def test_reward_weights_missing_offline_fail_before_the_model_loads_naming_the_option(monkeypatch, tmp_path):
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, check_reward_weights

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cache(monkeypatch, tmp_path)
    cfg = load_config(None, ["rewards=[{name: jpeg_compressibility}, {name: pickscore}]"])
    with pytest.raises(
        PreflightError,
        match=r"^rewards\[1\] \(pickscore\): model='yuvalkirstain/PickScore_v1' is neither a local path nor in the "
        r"Hugging Face cache .*HF_HUB_OFFLINE=1 forbids downloading it; .*rewards\.1\.kwargs\.model=/path/to/dir$",
    ):
        check_reward_weights(cfg)
    _cache(monkeypatch, tmp_path, "yuvalkirstain/PickScore_v1")  # the model cached: its processor is next
    with pytest.raises(PreflightError, match=r"processor='laion/CLIP-ViT-H-14-laion2B-s32B-b79K'"):
        check_reward_weights(cfg)
    _cache(monkeypatch, tmp_path, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    check_reward_weights(cfg)
    # a local copy is not looked for in the cache
    local = tmp_path / "clip"
    local.mkdir()
    _cache(monkeypatch, tmp_path / "empty")
    check_reward_weights(load_config(None, [f"rewards=[{{name: clip_score, kwargs: {{model: {local}}}}}]"]))


def test_a_reward_whose_weights_do_not_load_names_its_options_in_one_line(monkeypatch, tmp_path):
    from rewards.registry import RewardError, build

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cache(monkeypatch, tmp_path)
    with pytest.raises(RewardError) as info:
        build("clip_score", {"model": "no-such-org/no-such-clip", "device": "cpu"}, "image")
    message = str(info.value)
    assert "\n" not in message and ".." not in message
    assert message.startswith("reward 'clip_score' could not be built: OSError: ")
    assert "It loads model='no-such-org/no-such-clip'; this machine is offline (HF_HUB_OFFLINE=1)" in message
    assert message.endswith("e.g. kwargs: {model: /path/to/dir}")


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "1", None, True])
def test_a_weighted_component_weight_that_is_not_a_finite_number_is_refused(weight):
    """A component weight of NaN, inf, a string, null or a bool (given alone or in the component's dict) is one
    RewardConfigError naming the component, as a top-level weight is: a NaN weight would make every reward NaN."""
    alone = {"jpeg_compressibility": weight, "aesthetic": 1.0}
    in_dict = {"aesthetic": 1.0, "small": {"reward": "jpeg_compressibility", "weight": weight}}
    for components, key in ((alone, "jpeg_compressibility"), (in_dict, "small")):
        with pytest.raises(
            rewards.RewardConfigError,
            match=rf"^weighted component '{key}': (its weight must be a finite number|expected a weight)",
        ):
            rewards.check("weighted", {"components": components}, "image")


def test_a_weighted_reward_whose_weights_are_all_zero_is_refused():
    """All component weights 0: the sum is 0 for every sample, refused as an all-zero top-level weighting is; one
    component of weight 0 beside another is kept (it is logged)."""
    components = {"jpeg_compressibility": 0, "aesthetic": {"weight": 0.0}}
    with pytest.raises(rewards.RewardConfigError, match=r"every component's weight is 0 .*nothing to train on"):
        rewards.check("weighted", {"components": components}, "image")
    rewards.check("weighted", {"components": {**components, "jpeg_incompressibility": -0.5}}, "image")


def test_a_reward_of_the_other_kind_names_the_backend_or_the_remote_kind():
    """A text reward in an image run (a text run missing `backend: text`) names the backend key; a remote reward of
    the other kind names its kwargs.kind."""
    with pytest.raises(
        rewards.RewardConfigError, match=r"'accuracy' is a text reward; .*\(a text run sets backend: text\)\.$"
    ):
        rewards.check("accuracy", {}, "image")
    with pytest.raises(rewards.RewardConfigError, match=r"\(an image run sets backend: image\)\.$"):
        rewards.check("jpeg_compressibility", {}, "text")
    with pytest.raises(rewards.RewardConfigError, match=r"\(kwargs\.kind: text\); .*set its kwargs\.kind: image"):
        rewards.check("remote", {"url": "http://127.0.0.1:9", "kind": "text"}, "image")
