"""Rewards from the user's own code, named in the config as 'package.module:function' or
'path/to/file.py:function': checked cheaply, built, called with the config's kwargs, failures named."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from flowrl.errors import FlowrlError
from rewards import RewardConfigError, RewardError
from rewards._common import RewardState, call_text_reward

SCORES = '''
import numpy as np
import torch


def brightness(images, prompts, gain=1.0):
    """gain x mean luminance / 255, as a numpy array."""
    return np.array([gain * np.asarray(x.convert("L"), dtype=np.float64).mean() / 255 for x in images])


def as_list(images, prompts):
    return [float(len(p)) for p in prompts]


def as_tuple(images, prompts):
    return tuple(2.0 for _ in images)


def as_tensor(images, prompts, shape=None):
    return torch.tensor([[1.0 if s == "circle" else 0.0] for s in shape], dtype=torch.float64)  # [B, 1]


def broken(images, prompts):
    return 1 / 0


def too_few(images, prompts):
    return [1.0]


def words(prompts, completions, scale=1.0):
    """A TRL-style text reward."""
    return [scale * len(c.split()) for c in completions]


class Scorer:
    def __call__(self, images, prompts):
        self.last_components = {"ones": torch.ones(len(images))}
        return torch.zeros(len(images))


scorer = Scorer()
not_a_function = 3
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The test's own working directory and sys.path; the modules it imports from there are forgotten after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def gray(level: int, n: int = 1) -> list[Image.Image]:
    return [Image.new("RGB", (4, 4), (level, level, level)) for _ in range(n)]


def test_file_plugin_is_the_reward_with_config_kwargs_on_every_call(workdir):
    write(workdir / "lib" / "scores.py", SCORES)
    reward = rewards.build("lib/scores.py:brightness", {"gain": 2.0}, "image")
    assert reward.kind == "image" and reward.__name__ == "lib/scores.py:brightness"
    images = gray(255) + gray(51)
    out = reward(images, ["a", "b"], shape=["circle", "square"])  # a column it does not take is not passed
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([2.0, 0.4]))  # 2 x 255/255, 2 x 51/255
    torch.testing.assert_close(reward(gray(255), ["a"]), torch.tensor([2.0]))  # the kwargs again


def test_a_plugins_last_components_are_checked_and_named(workdir):
    """last_components, read by the trainer and the eval as one number per sample each: a mapping of numbers of
    the call's size, else one RewardError naming the reward and the component (a traceback in the loop before)."""
    write(
        workdir / "comps.py",
        """
        import torch

        class Comps:
            def __init__(self, value):
                self.value = value

            def __call__(self, images, prompts):
                self.last_components = self.value(len(images))
                return [0.0] * len(images)

        good = Comps(lambda n: {"a": [1] * n, "b": torch.ones(n, 1, dtype=torch.float64)})
        strings = Comps(lambda n: {"a": ["x"] * n})
        not_a_dict = Comps(lambda n: [1.0] * n)
        too_many = Comps(lambda n: {"a": [1.0] * (n + 3)})
        meta = Comps(lambda n: {"a": torch.ones(n, device="meta")})
        """,
    )
    reward = rewards.build("comps.py:good", {}, "image")
    reward(gray(1, 2), ["a", "b"])
    comps = reward.last_components
    assert set(comps) == {"a", "b"} and all(v.dtype == torch.float32 and v.shape == (2,) for v in comps.values())
    for name, words in (
        ("strings", r"last_components\['a'\] is not numbers"),
        ("not_a_dict", r"last_components is list, not a mapping"),
        ("too_many", r"last_components\['a'\] holds 5 values for a call of 2 samples"),
        ("meta", r"last_components\['a'\] holds a tensor on the meta device"),
    ):
        with pytest.raises(RewardError, match=rf"reward 'comps.py:{name}': {words}"):
            rewards.build(f"comps.py:{name}", {}, "image")(gray(1, 2), ["a", "b"])


def test_an_option_a_letter_off_a_parameter_of_a_kwargs_reward_is_a_warning(workdir):
    """A reward that takes **metadata takes any option, so a misspelt one (gian for gain) would go there and the
    parameter keep its default without a word: it is built, with one warning naming the parameter meant; an option
    far from every parameter (a column the reward reads from its metadata) is taken quietly."""
    import warnings

    write(workdir / "kw.py", "def bright(images, prompts, gain=1.0, **metadata):\n    return [gain] * len(images)\n")
    with pytest.warns(
        UserWarning, match=r"option 'gian' is not a parameter of bright\(.*\*\*metadata.*did you mean 'gain'"
    ):
        reward = rewards.build("kw.py:bright", {"gian": 2.0}, "image")
    torch.testing.assert_close(reward(gray(255), ["a"]), torch.tensor([1.0]))  # the default gain: what was warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rewards.build("kw.py:bright", {"gain": 2.0, "style": "x"}, "image")
        rewards.check("kw.py:bright", {"gian": 2.0}, "image")  # said once a process (the check, then the build)
        rewards.build("kw.py:bright", {"gian": 2.0}, "image")


def test_module_plugin_from_the_working_directory_and_every_output_type(workdir):
    write(workdir / "userpkg_a" / "__init__.py", "")
    write(workdir / "userpkg_a" / "scores.py", SCORES)
    images = gray(0, 2)
    expected = {"as_list": [1.0, 3.0], "as_tuple": [2.0, 2.0], "as_tensor": [1.0, 0.0]}
    for name, values in expected.items():
        reward = rewards.build(f"userpkg_a.scores:{name}", {}, "image")
        out = reward(images, ["a", "ccc"], shape=["circle", "square"])
        assert out.dtype == torch.float32 and out.shape == (2,)
        assert out.tolist() == values, name


def test_text_plugin_takes_the_backend_kind_and_trl_arguments(workdir):
    write(workdir / "scores.py", SCORES)
    reward = rewards.build("scores.py:words", {"scale": 0.5}, "text")
    assert reward.kind == "text"
    logs: dict[str, list[float]] = {}
    out = call_text_reward(
        reward,
        ["q", "q"],
        ["one two", "a b c d"],
        [[1, 2], [3]],
        {"answer": ["2", "4"]},
        state=RewardState(),
        logs=logs,
    )
    assert out == [1.0, 2.0]  # 0.5 x words; trainer_state, log_metric, columns not passed: it does not take them
    assert reward(["q"], ["x y"]) == [1.0]  # positionally too


def test_declared_kind_wins_and_a_mismatch_is_an_error(workdir):
    write(
        workdir / "declared.py",
        """
        def shout(prompts, completions, **kwargs):
            return [float(c.isupper()) for c in completions]
        shout.kind = "text"
    """,
    )
    assert rewards.build("declared.py:shout", {}, "text").kind == "text"
    with pytest.raises(
        RewardConfigError,
        match=r"'declared.py:shout' is a text reward \(its \.kind\); this backend "
        r"needs image rewards",
    ):
        rewards.check("declared.py:shout", {}, "image")


def test_a_failing_plugin_is_named_and_chained(workdir):
    write(workdir / "scores.py", SCORES)
    reward = rewards.build("scores.py:broken", {}, "image")
    line = SCORES.splitlines().index("    return 1 / 0") + 1  # the plug-in's line that raised, named
    with pytest.raises(
        RewardError,
        match=rf"^reward 'scores.py:broken' failed: ZeroDivisionError: division by zero \(at scores.py:{line}, in "
        rf"broken\)$",
    ) as info:
        reward(gray(0), ["a"])
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert isinstance(info.value, FlowrlError)  # the command line prints its one line
    with pytest.raises(RewardError, match=r"^reward 'scores.py:too_few' returned 1 scores for 3 images"):
        rewards.build("scores.py:too_few", {}, "image")(gray(0, 3), ["a"] * 3)
    from rewards._common import image_scores

    with pytest.raises(ValueError, match=r"^reward 'r' returned 4 scores \(shape \[2, 2\]\) for 2 images; an image"):
        image_scores([[1.0, 2.0], [3.0, 4.0]], 2, "r")
    assert image_scores([[1.0], [2.0]], 2, "r").tolist() == [1.0, 2.0]  # [n, 1]: one number per image
    assert image_scores([[1.0, 2.0]], 2, "r").tolist() == [1.0, 2.0]  # [1, n] too
    # n numbers that are not one per image (a [2, 2] for 4 images) are not read in some order
    with pytest.raises(ValueError, match=r"returned 4 scores \(shape \[2, 2\]\) for 4 images; .*\(\[4\], or a column"):
        image_scores([[1.0, 2.0], [3.0, 4.0]], 4, "r")
    with pytest.raises(ValueError, match=r"returned list that is not numbers \('0\.5' is text: convert each score "):
        image_scores([0.5, "0.5"], 2, "r")
    # a finite score float32 cannot hold would become an infinity (read as no score): refused, naming it
    import numpy as np

    for huge in ([1e39, 1.0], np.array([1.0, -2e40])):
        with pytest.raises(ValueError, match=r"^reward 'r' returned the score -?[12]e\+(39|40), beyond float32's"):
            image_scores(huge, 2, "r")
    assert image_scores([float("inf"), 3e38], 2, "r").tolist() == [float("inf"), pytest.approx(3e38)]


def test_a_failure_inside_a_library_names_the_plugins_line_that_called_it(workdir):
    """The innermost frame outside Python's and the installed packages' files: the plug-in's call into json."""
    write(
        workdir / "parse.py",
        """
        import json

        def score(images, prompts):
            return json.loads(prompts[0])
    """,
    )
    with pytest.raises(RewardError, match=r"failed: JSONDecodeError: .* \(at parse.py:5, in score\)$"):
        rewards.build("parse.py:score", {}, "image")(gray(0), ["not json"])


def test_a_failing_async_reward_is_named(workdir):
    write(
        workdir / "slow.py",
        """
        import asyncio

        async def judge(prompts, completions, **kwargs):
            await asyncio.sleep(0)
            raise ConnectionError("judge unreachable")
    """,
    )
    reward = rewards.build("slow.py:judge", {}, "text")
    with pytest.raises(RewardError, match=r"^reward 'slow.py:judge' failed: ConnectionError: judge unreachable"):
        call_text_reward(reward, ["q"], ["a"], None, {}, state=RewardState(), logs={})


def test_last_components_and_attributes_of_the_wrapped_reward_stay_reachable(workdir):
    write(workdir / "scores.py", SCORES)
    reward = rewards.build("scores.py:scorer", {}, "image")
    assert reward.last_components == {}
    reward(gray(0, 2), ["a", "b"])
    torch.testing.assert_close(reward.last_components["ones"], torch.ones(2))
    jpeg = rewards.build("jpeg_compressibility", {"quality": 50}, "image")
    jpeg(gray(9, 2), ["a", "b"])
    assert set(jpeg.last_components) == {"jpeg_kb"} and jpeg.quality == 50


@pytest.mark.parametrize(
    "name, kwargs, kind, message",
    [
        (
            "missing.py:f",
            {},
            "image",
            r"^reward 'missing.py:f': file 'missing.py' not found \(looked for .*missing.py\)$",
        ),
        ("nosuchpkg_x.scores:f", {}, "image", r"module 'nosuchpkg_x.scores' not found \(no module named 'nosuchpkg_x'"),
        (
            "scores.py:brightnes",
            {},
            "image",
            r"'scores.py' has no attribute 'brightnes'\. Did you mean 'brightness'\? "
            r"Its public callables: as_list, as_tensor, as_tuple, brightness, broken, "
            r"scorer, too_few, words\.$",
        ),
        (
            "scores.py:not_a_function",
            {},
            "image",
            r"'scores.py:not_a_function' is not callable \(type int\); name a function",
        ),
        ("scores.py:Scorer", {}, "image", r"'scores.py:Scorer' is a class; name the reward function, or an instance"),
        (
            "scores.py:brightness",
            {"gian": 2},
            "image",
            r"unknown option\(s\) 'gian'\. Did you mean 'gain'\? Valid "
            r"options: gain \(signature brightness\(images, prompts, gain=1.0\)\)",
        ),
        (
            "scores.py:brightness",
            {"prompts": ["x"]},
            "image",
            r"option\(s\) 'prompts' would replace what every image "
            r"reward is called with",
        ),
        (
            "scores.py:words",
            {},
            "image",
            r"an image reward is called as f\(images, prompts, \*\*metadata\), but its "
            r"signature is words\(prompts, completions, scale=1.0\) \(its parameters prompts, "
            r"completions are a text reward's\)",
        ),
        (
            "scores.py:brightness",
            {},
            "text",
            r"a text reward is called as f\(prompts=\.\.\., completions=\.\.\., "
            r"\*\*columns\) \(TRL's signature\).*its parameters images, prompts",
        ),
        ("scores.py:", {}, "image", r"needs both parts around the ':'"),
    ],
)
def test_check_names_what_is_wrong(workdir, name, kwargs, kind, message):
    write(workdir / "scores.py", SCORES)
    with pytest.raises(RewardConfigError, match=message):
        rewards.check(name, kwargs, kind)


def test_check_reports_syntax_errors_with_their_line_and_import_failures(workdir):
    write(workdir / "typo.py", "def ok(images, prompts):\n    return [1.0]\n\n\ndef bad(:\n    pass\n")
    with pytest.raises(RewardConfigError, match=r"^reward 'typo.py:ok': syntax error in typo.py line 5: "):
        rewards.check("typo.py:ok", {}, "image")
    write(workdir / "userpkg_b" / "__init__.py", "")
    write(workdir / "userpkg_b" / "typo.py", "x = 1\ny = (\n")
    with pytest.raises(RewardConfigError, match=r"syntax error in .*userpkg_b/typo.py line 2: "):
        rewards.check("userpkg_b.typo:x", {}, "image")
    write(workdir / "needs.py", "import not_installed_package_q\n")
    with pytest.raises(
        RewardConfigError, match=r"file 'needs.py' imports 'not_installed_package_q', which is not installed"
    ):
        rewards.check("needs.py:f", {}, "image")
    write(workdir / "raises.py", "import math\nSCALE = 1 / 0\n")
    with pytest.raises(
        RewardConfigError,
        match=r"running file 'raises.py' raised ZeroDivisionError: division by zero "
        r"\(.*raises.py line 2\)$",
    ):
        rewards.check("raises.py:f", {}, "image")


def test_check_is_cheap_and_a_failed_file_can_be_fixed(workdir):
    write(
        workdir / "counted.py",
        """
        CALLS = []

        def f(images, prompts):
            CALLS.append(1)
            return [0.0] * len(images)
    """,
    )
    rewards.check("counted.py:f", {}, "image")
    reward = rewards.build("counted.py:f", {}, "image")
    module = sys.modules[reward.reward.__module__]
    assert module.CALLS == []  # neither check nor build scores anything
    reward(gray(0), ["a"])
    assert module.CALLS == [1]
    write(workdir / "fixme.py", "def f(:\n")
    with pytest.raises(RewardConfigError, match="syntax error"):
        rewards.check("fixme.py:f", {}, "image")
    write(workdir / "fixme.py", "def f(images, prompts):\n    return [1.0] * len(images)\n")
    assert rewards.build("fixme.py:f", {}, "image")(gray(0), ["a"]).tolist() == [1.0]


def test_positional_text_rewards_and_numpy_scores(workdir):
    write(
        workdir / "positional.py",
        """
        import numpy as np

        def lengths(prompts, texts, **columns):
            return np.array([len(t) for t in texts], dtype=np.float32)
    """,
    )
    reward = rewards.build("positional.py:lengths", {}, "text")
    out = call_text_reward(reward, ["q", "q"], ["ab", "abcd"], None, {}, state=RewardState(), logs={})
    assert out == [2.0, 4.0] and all(type(v) is float for v in out)


def test_async_plugin_runs_inside_a_running_event_loop(workdir):
    write(
        workdir / "judge.py",
        """
        import asyncio

        async def judge(prompts, completions, trainer_state, **kwargs):
            await asyncio.sleep(0)
            return [float(trainer_state.global_step) for _ in completions]
    """,
    )
    reward = rewards.build("judge.py:judge", {}, "text")

    async def caller():  # e.g. a notebook: this thread's loop is running
        return call_text_reward(reward, ["q"], ["a"], None, {}, state=RewardState(global_step=7), logs={})

    assert asyncio.run(caller()) == [7.0]


def test_registered_rewards_build_wrapped_and_unknown_names_list_plugins_too():
    reward = rewards.build("think_format", {}, "text")
    assert reward.__name__ == "think_format" and reward.kind == "text"
    assert reward(["q"], ["<think>a</think><answer>1</answer>"]) == [1.0]
    with pytest.raises(
        RewardConfigError, match=r"or a plug-in 'package.module:function' or 'path/to/file.py:function'"
    ):
        rewards.check("brightness", {}, "image")
    np.testing.assert_array_equal(rewards.build("jpeg_compressibility", {}, "image")(gray(0), ["a"]).shape, (1,))


def test_an_option_that_is_also_a_prompt_column_is_refused_before_the_model_loads(workdir):
    """Each prompt's columns reach a reward as arguments of their names: an option of the same name would be
    refused at the first call, after the model loaded and the first eval sampled; it is refused with the prompts."""
    import json

    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, check_reward_columns, load_prompt_sets

    write(workdir / "show.py", "def show(images, prompts, **metadata):\n    return [0.0] * len(images)\n")
    (workdir / "p.jsonl").write_text(json.dumps({"prompt": "a cat", "family": "x"}) + "\n")
    base = [f"data.train_prompts={workdir / 'p.jsonl'}"]
    cfg = load_config(None, [*base, "rewards=[{name: 'show.py:show', kwargs: {family: y}}]"])
    with pytest.raises(
        PreflightError, match=r"rewards\[0\] \(show.py:show\): its option\(s\) 'family' are also columns"
    ):
        check_reward_columns(cfg, *load_prompt_sets(cfg))
    cfg = load_config(None, [*base, "rewards=[{name: 'show.py:show', kwargs: {style: y}}]"])
    check_reward_columns(cfg, *load_prompt_sets(cfg))
