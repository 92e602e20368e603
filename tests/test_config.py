"""Config tree: presets, overrides, validation messages, docs from field docstrings."""

import re

import pytest

from flowrl.config import Config, ConfigError, describe, field_docs, load_config, parse_overrides


def test_defaults_validate_and_overrides_apply(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text(
        "train:\n  lr: 1e-4\n  epochs: 3\nsample:\n  group_size: 8\n"
        "rewards:\n  - name: jpeg_compressibility\n    weight: 2\n"
    )
    cfg = load_config(yml, ["train.epochs=5", "train.grpo.window.kind=fixed", "train.grpo.window.size=2"])
    assert cfg.train.lr == 1e-4  # YAML reads "1e-4" as a string; the float field converts it
    assert cfg.train.epochs == 5 and cfg.sample.group_size == 8
    assert cfg.train.grpo.window.kind == "fixed" and cfg.train.grpo.window.size == 2
    assert cfg.rewards[0].weight == 2.0 and isinstance(cfg.rewards[0].weight, float)


def test_unknown_key_names_close_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.lrr.*Did you mean train\.lr"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"Valid keys here: backend, model, lora, sample"):
        load_config(None, ["trian.lr=1"])
    yml = tmp_path / "bad.yaml"
    yml.write_text("sample:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=r"sample\.group_sise.*Did you mean sample\.group_size"):
        load_config(yml)
    yml.write_text("rewards:\n  - nam: pickscore\n")
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.nam"):
        load_config(yml)


def test_every_unknown_key_of_a_file_is_named_at_once(tmp_path):
    # four mistakes in three sections and a list item: one error lists them all, each with its own suggestion (the
    # section's own key first: train.dpo.betta is train.dpo.beta, not grpo's or crd's beta)
    yml = tmp_path / "bad.yaml"
    yml.write_text(
        "model:\n  devise: cpu\ntrain:\n  lrr: 1e-3\n  dpo:\n    betta: 100\n"
        "rewards:\n  - name: pickscore\n    kwarg: {}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(yml)
    lines = str(e.value).splitlines()
    assert lines[0] == "4 unknown config keys:"
    assert [line.split("'")[1] for line in lines[1:]] == [
        "model.devise",
        "train.lrr",
        "train.dpo.betta",
        "rewards[0].kwarg",
    ]
    # each named at its line of the file (model.devise at line 2, train.lrr 4, train.dpo.betta 6, the kwarg 9)
    assert [line.split(": unknown")[0] for line in lines[1:]] == [f"  - {yml}:{n}" for n in (2, 4, 6, 9)]
    assert "Did you mean model.device " in lines[1] and "Did you mean train.lr " in lines[2]
    assert "Did you mean train.dpo.beta?" in lines[3] and "Did you mean rewards[0].kwargs " in lines[4]
    # one unknown key: the one-line message as before
    yml.write_text("train:\n  lrr: 1e-3\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr'\. Did you mean train\.lr ") as e:
        load_config(yml)
    assert str(e.value).startswith(f"{yml}:2: unknown config key")
    # a key of the command line has no line: the message alone
    yml.write_text("train:\n  epochs: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(yml, ["train.lrr=1e-3"])
    assert str(e.value).startswith("unknown config key 'train.lrr'.")


@pytest.mark.parametrize(
    "override, message",
    [
        ("sample.group_size=1", "group_size must be >= 2"),
        ("train.minibatch_size=3", "must divide the epoch batch 16"),
        ("train.grpo.sde_type=euler", "valid: auto, sde, cps, dance, ddim"),
        ("train.lr=abc", "expected a number"),
        ("lora.enabled=maybe", "expected true or false"),
        ("train.adv_estimator=ppo", "valid: dr_grpo, grpo, reinforce_pp, rloo"),
        ("train.grpo.policy_loss=ppo", "valid: dppo, gspo, ppo_clip"),
        ("train.grpo.window.kind=fixed", "window"),
        ("train.grpo.dual_clip=0.5", "dual_clip must be > 1"),
        ("train.decay_frac=0", r"train.decay_frac must be in \(0, 1\]"),
        ("rewards=[{name: shapes_geneval, weight: 0}]", "every weight is 0 .shapes_geneval., so there is nothing"),
        ("train.lr=inf", r"train.lr must be a finite number > 0, got inf"),
        ("train.lr=nan", r"train.lr must be a finite number > 0, got nan"),
        ("rewards.0.weight=nan", r"rewards\[0\].weight must be a finite number, got nan"),  # (said once)
        ("log.run_dir=", r"log.run_dir is empty: a run writes its checkpoints, metrics and grids there"),
        ("log.run_dir='  '", r"log.run_dir is empty"),
    ],
)
def test_bad_values_are_errors_before_work(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["sample.prompts_per_epoch=4", override])


def test_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["train.lr"])
    assert parse_overrides(["lora.target_modules=[to_q, to_k]"]) == {"lora": {"target_modules": ["to_q", "to_k"]}}


def test_every_field_has_a_docstring():
    rows = describe(Config)
    assert len(rows) > 50
    missing = [key for key, _, _, doc in rows if not doc]
    assert not missing, f"fields without a docstring: {missing}"
    assert "Flow-GRPO" in field_docs(type(Config().train.grpo))["clip_low"]


def test_every_preset_loads_and_validates():
    from pathlib import Path

    presets = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(presets) >= 7
    for p in presets:
        cfg = load_config(p)
        assert cfg.sample.group_size >= 2, p
    pick = load_config(Path(__file__).resolve().parents[1] / "configs" / "sd35m_pickscore.yaml")
    # Flow-GRPO's recipe, as the preset promises
    assert (pick.sample.height, pick.sample.num_steps, pick.eval.num_steps, pick.sample.group_size) == (512, 10, 40, 24)
    assert (pick.train.grpo.clip_low, pick.train.grpo.beta, pick.lora.rank, pick.lora.alpha, pick.train.lr) == (
        1e-4,
        0.01,
        32,
        64.0,
        3e-4,
    )


def test_a_preset_run_from_another_directory_names_where_its_paths_are(tmp_path, monkeypatch):
    """configs/shapes.yaml names samples/shapes/... relative to the repository: from another working directory a
    warning says so, naming the folder to run from; from the repository (or with absolute paths) nothing is said."""
    import warnings
    from pathlib import Path

    from flowrl.config import ConfigWarning

    repo = Path(__file__).resolve().parents[1]
    preset = repo / "configs" / "shapes.yaml"
    monkeypatch.chdir(tmp_path)
    with pytest.warns(ConfigWarning) as seen:
        load_config(preset)
    text = " ".join(str(w.message) for w in seen)
    for key in ("model.path=samples/shapes/model", "data.train_prompts=samples/shapes/train.jsonl", "eval.base_cache"):
        assert key in text
    assert f"run from {repo}" in text and str(tmp_path) in text
    # a path that is nowhere (a hub id) and paths made absolute: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(
            preset,
            [
                "model.path=org/some-model",
                f"data.train_prompts={repo}/samples/shapes/train.jsonl",
                f"data.eval_prompts={repo}/samples/shapes/test.jsonl",
                f"eval.base_cache={repo}/samples/shapes/base-evals",
            ],
        )
        monkeypatch.chdir(repo)
        load_config(preset)


def test_a_plug_in_file_beside_the_config_is_named_from_another_directory(tmp_path, monkeypatch):
    """A reward `my.py:score` and a tool environment `env.py:answer` in the config's folder, the run started from
    elsewhere: the warning names them (the registry's error, which comes after, says where it looked)."""
    from flowrl.config import ConfigWarning

    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "my.py").write_text("def score(images, prompts):\n    return [0.0] * len(images)\n")
    (tmp_path / "cfgs" / "env.py").write_text("def answer(turn):\n    return None\n")
    config = tmp_path / "cfgs" / "c.yaml"
    config.write_text("rewards:\n  - name: my.py:score\n  - name: gone.py:other\ntext:\n  tool_env: env.py:answer\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.warns(ConfigWarning) as seen:
        load_config(config, ["backend=text", "text.tool_stop=[x]"])
    (text,) = [str(w.message) for w in seen if "near the config file" in str(w.message)]
    assert text.startswith("rewards[0].name=my.py:score, text.tool_env=env.py:answer: not in the working directory")
    assert f"so run from {tmp_path / 'cfgs'}" in text and "gone.py" not in text
    monkeypatch.chdir(tmp_path / "cfgs")
    assert not [w for w in _warned(lambda: load_config(config, ["backend=text"])) if "near the config" in w]


def _warned(call) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in seen]


def test_a_path_under_the_home_directory_is_expanded_as_a_prompt_files_always_was(tmp_path, monkeypatch):
    """`~` in a path key (YAML, or after `=` in an override, where no shell expands it) is the home directory:
    model.path=~/models/x was read as a hub id, log.run_dir=~/runs/x made a folder named `~`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    keys = ["model.path", "lora.init_path", "log.run_dir", "eval.base_cache", "data.eval_prompts"]
    cfg = load_config(None, [f"{key}=~/x/{i}" for i, key in enumerate(keys)])
    values = [cfg.model.path, cfg.lora.init_path, cfg.log.run_dir, cfg.eval.base_cache, cfg.data.eval_prompts]
    assert values == [f"{tmp_path}/x/{i}" for i in range(len(keys))]
    assert load_config(None, ["model.path=org/name~1"]).model.path == "org/name~1"  # only a leading ~


def test_a_key_given_twice_in_a_yaml_mapping_is_refused_with_both_lines(tmp_path):
    """Plain YAML keeps a repeated key's last value silently (a second `model:` section replaces the first): the
    config file says where both are instead."""
    yml = tmp_path / "c.yaml"
    yml.write_text("model:\n  path: a\ntrain:\n  lr: 1.0e-3\nmodel:\n  device: cpu\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(yml))}:5: 'model' is given twice in one mapping \(first at line 1\)"
    ):
        load_config(yml)
    yml.write_text("train:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r":4: 'lr' is given twice in one mapping \(first at line 2\)"):
        load_config(yml)
    yml.write_text("train:\n  <<: {lr: 3.0e-3, epochs: 5}\n  epochs: 2\n")  # a merge key's keys may be given again
    assert (load_config(yml).train.lr, load_config(yml).train.epochs) == (3.0e-3, 2)


def test_a_directory_given_as_the_config_says_a_model_directory_goes_in_model_path(tmp_path):
    (tmp_path / "my_model").mkdir()
    (tmp_path / "my_model" / "model_index.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"is a directory \(a model's directory, which a config names as model.path\)"
    ):
        load_config(tmp_path / "my_model")
    with pytest.raises(ConfigError, match=r"is a directory; give a YAML config file$"):
        load_config(tmp_path)
    for name in ("b.yaml", "a.yml", "c.yaml", "d.yaml"):  # a folder of configs (configs/): its files named
        (tmp_path / name).write_text("{}")
    with pytest.raises(
        ConfigError, match=r"is a directory; give one of its YAML files \(a\.yml, b\.yaml, c\.yaml, \.\.\.\)$"
    ):
        load_config(tmp_path)
