"""Rewards of other packages, found through the `flowrl.rewards` entry-point group: a tiny third-party distribution
(a `*.dist-info` folder with METADATA and entry_points.txt, and its package) put on sys.path, as pip would install it.
Its rewards are listed, checked, built and planned like the built-in ones; a broken entry point is one line naming
the distribution and the entry point, when its reward is asked for, and leaves the other rewards alone."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch
from PIL import Image

import rewards
import rewards.registry as registry

# the broken entry points warn whenever the rewards of a kind are listed; the tests below ask for those warnings
pytestmark = pytest.mark.filterwarnings("ignore:reward 'their_")

ENTRY_POINTS = """\
[flowrl.rewards]
their_name = their_pkg.scores
their_broken = their_pkg.broken
their_attribute = their_pkg.scores:Brightness
their_silent = their_pkg.silent
"""

SCORES = '''\
"""A third party's reward module: it registers its reward as a file of the rewards package does."""
import numpy as np
import torch

import rewards


@rewards.register("their_name", kind=rewards.IMAGE,
                  memory=[rewards.HubModel("openai/clip-vit-large-patch14", "CLIPModel")])
class Brightness:
    """gain * the mean luminance in [0, 1]."""

    def __init__(self, gain: float = 1.0):
        self.gain = gain

    def __call__(self, images, prompts, **metadata):
        return torch.tensor([self.gain * np.asarray(x.convert("L"), dtype=np.float64).mean() / 255 for x in images])
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder on sys.path holding the distribution `their-dist` 1.0 and its package `their_pkg`; taken off the
    path, with the rewards it registered and its modules, after this module's tests."""
    root = tmp_path_factory.mktemp("site")
    info = root / "their_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: their-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    package = root / "their_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(SCORES)
    (package / "broken.py").write_text("import numpyy_is_not_installed\n")
    (package / "silent.py").write_text("VALUE = 1  # registers nothing\n")
    rewards.available()  # the built-in rewards registered before the registry is copied
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry.REWARDS, "_items", dict(registry.REWARDS._items))
        patch.syspath_prepend(str(root))  # (also invalidates the import and metadata caches)
        yield root
    for name in [m for m in sys.modules if m == "their_pkg" or m.startswith("their_pkg.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def images(*grays: int) -> list[Image.Image]:
    return [Image.new("RGB", (4, 4), (g, g, g)) for g in grays]


def test_names_are_listed_without_importing_the_package(site):
    names = rewards.available()
    assert {"their_name", "their_broken", "their_attribute", "their_silent", "pickscore"} <= set(names)
    assert names == sorted(names)
    assert "their_pkg.broken" not in sys.modules


def test_the_entry_point_reward_builds_and_scores_images(site):
    reward = rewards.build("their_name", {"gain": 2.0}, "image")
    assert reward.kind == "image" and reward.__name__ == "their_name"
    # 2 x luminance 51/255 = 0.4, 2 x 255/255 = 2
    assert reward(images(51, 255), ["a", "b"]).tolist() == pytest.approx([0.4, 2.0])
    assert rewards.get("their_name").gain == 1.0
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"'their_name' got unknown option\(s\) 'gian'\. Did you "
        r"mean 'gain'",
    ):
        rewards.check("their_name", {"gian": 2.0}, "image")
    with pytest.raises(rewards.RewardConfigError, match="'their_name' is an image reward; this backend needs text"):
        rewards.check("their_name", {}, "text")


def test_a_flowrl_config_names_it_and_preflight_accepts_it(site):
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, check_rewards

    cfg = load_config(None, ["rewards.0.name=their_name", "rewards.0.kwargs={gain: 3.0}"])
    check_rewards(cfg)
    with pytest.raises(PreflightError, match=r"unknown reward 'their_nmae'\. Did you mean 'their_name'"):
        check_rewards(load_config(None, ["rewards.0.name=their_nmae"]))


def test_a_broken_entry_point_is_one_line_naming_the_distribution_and_spares_the_others(site):
    expected = (
        r"^reward 'their_broken': entry point their_broken = their_pkg.broken \(group flowrl.rewards\) of "
        r"distribution their-dist 1.0 failed to import: ModuleNotFoundError: No module named "
        r"'numpyy_is_not_installed'$"
    )
    for ask in (
        lambda: rewards.get("their_broken"),
        lambda: rewards.check("their_broken", {}, "image"),
        lambda: rewards.build("their_broken", {}, "image"),
        lambda: rewards.memory_spec("their_broken"),
    ):
        with pytest.raises(rewards.RewardConfigError, match=expected):
            ask()
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, check_rewards

    with pytest.raises(PreflightError, match="their-dist 1.0") as error:
        check_rewards(load_config(None, ["rewards.0.name=their_broken"]))
    assert "\n" not in str(error.value)
    # the other rewards: built, checked, listed by kind (the broken one left out, with the same line as a warning)
    assert rewards.build("jpeg_compressibility", {}, "image")(images(0), ["p"]).shape == (1,)
    rewards.check("their_name", {}, "image")
    with pytest.warns(UserWarning, match=expected[1:-1]):
        image_rewards = rewards.available("image")
    assert "their_name" in image_rewards and "pickscore" in image_rewards and "their_broken" not in image_rewards
    with pytest.warns(UserWarning, match="their_broken"):
        assert "their_name" not in rewards.available("text") and "accuracy" in rewards.available("text")


def test_an_entry_point_must_name_a_module_that_registers_its_name(site):
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'their_attribute': entry point their_attribute = "
        r"their_pkg.scores:Brightness .* of distribution their-dist 1.0 "
        r"names an attribute; its value must be a module",
    ):
        rewards.get("their_attribute")
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'their_silent': entry point their_silent = "
        r"their_pkg.silent .*: module their_pkg.silent registered "
        r"nothing, not 'their_silent'; it must call "
        r"rewards.register\('their_silent', kind=...\)$",
    ):
        rewards.check("their_silent", {}, "image")


def test_its_memory_declaration_reaches_the_planner(site):
    assert rewards.memory_spec("their_name") == [
        rewards.HubModel("openai/clip-vit-large-patch14", "CLIPModel", "float32", reward="their_name")
    ]
    from flowrl.config import load_config
    from flowrl.plan import reward_components

    parts, notes = reward_components(load_config(None, ["rewards.0.name=their_name"]).rewards)
    assert [(p.name, p.class_name) for p in parts] == [("reward their_name", "CLIPModel openai/clip-vit-large-patch14")]
    assert notes == [] and parts[0].params / 1e9 == pytest.approx(0.428, rel=0.01)


def test_entry_points_are_read_afresh_when_sys_path_changes(site, monkeypatch):
    """Nothing caches the entry points: off the path, the distribution's unloaded rewards are gone (the loaded
    one stays registered); back on it, they are found again."""
    rewards.get("their_name")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(site)])
    importlib.invalidate_caches()
    names = rewards.available()
    assert "their_broken" not in names and "their_silent" not in names and "their_name" in names
    with pytest.raises(rewards.RewardConfigError, match="unknown reward 'their_broken'"):
        rewards.get("their_broken")
    monkeypatch.undo()
    importlib.invalidate_caches()
    assert "their_broken" in rewards.available()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.is_tensor(rewards.get("their_name")(images(0), ["p"]))
