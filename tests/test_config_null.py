"""`null` (and `none`) for a key that can be off: None for an Optional field, "" for a text field whose default is
"" (empty = off, e.g. data.balance_by), alike in overrides and YAML; any other key refuses it in one line."""

import pytest

from flowrl.config import ConfigError, describe, load_config

ROWS = describe()
OPTIONAL = [key for key, kind, _, _ in ROWS if kind.endswith("|null")]
EMPTY_OFF = [key for key, kind, default, _ in ROWS if kind == "str" and default == ""]


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_there_are_keys_of_both_kinds():
    assert {"checkpoint.resume", "lora.init_path", "train.grpo.clip_high"} <= set(OPTIONAL)
    assert {"data.balance_by", "eval.group_by", "data.eval_prompts"} <= set(EMPTY_OFF)


@pytest.mark.parametrize("spelling", ["null", "~", "none", "None", "NULL"])
@pytest.mark.parametrize("key", OPTIONAL + EMPTY_OFF)
def test_null_turns_a_key_off(key, spelling):
    cfg = load_config(None, [f"{key}={spelling}"])
    assert _get(cfg, key) == (None if key in OPTIONAL else "")


def test_null_in_a_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  balance_by: null\ncheckpoint:\n  resume: none\neval:\n  group_by:\n")
    cfg = load_config(path)
    assert (cfg.data.balance_by, cfg.checkpoint.resume, cfg.eval.group_by) == ("", None, "")


def test_other_keys_keep_their_meaning_of_none_and_refuse_null():
    assert load_config(None, ["train.adv_scale=none"]).train.adv_scale == "none"  # a choice named none
    with pytest.raises(ConfigError, match=r"^data\.image_column: expected a string, got null \(write "):
        load_config(None, ["data.image_column=null"])
    with pytest.raises(ConfigError, match=r"^train\.lr: expected a number, got None"):
        load_config(None, ["train.lr=null"])


def test_a_string_key_given_an_unquoted_template_says_to_quote_it(tmp_path):
    """YAML reads `{prompt}` unquoted as a mapping ({'prompt': None}): in a file the error says to quote it; on
    the command line a text key takes it as written (also where YAML would not read it at all)."""
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  prompt_template: {prompt}\n")
    with pytest.raises(
        ConfigError, match=r"^data\.prompt_template: expected a string, got \{'prompt': None\}: YAML"
    ) as e:
        load_config(path)
    assert 'quote the value, e.g. data.prompt_template: "{prompt}, a photo"' in str(e.value)
    for raw in ("{prompt}", "{prompt}, {style} in watercolor", "[{prompt}]", "{prompt}: a photo"):
        assert load_config(None, [f"data.prompt_template={raw}"]).data.prompt_template == raw
    # YAML's meaning stays for the rest: null forms, quotes, another type's key
    assert load_config(None, ["data.balance_by=~"]).data.balance_by == ""
    assert load_config(None, ["model.variant=null"]).model.variant is None
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(None, ["train.adam_betas=[0.9, 0.95"])
    path.write_text("data:\n  prompt_template: [a, b]\n")
    with pytest.raises(
        ConfigError, match=r"got \['a', 'b'\]: YAML reads an unquoted \{\.\.\.\} or \[\.\.\.\] as a list"
    ):
        load_config(path)
    assert load_config(None, ['data.prompt_template="{prompt}, a photo"']).data.prompt_template == "{prompt}, a photo"


def test_a_value_ending_in_a_colon_is_named_as_such():
    """`rewards.0.name=r.py:` (a plug-in reward without its function) is read by YAML as the mapping {r.py: null}:
    the error names the value and its colon, and the plug-in form, not YAML's braces."""
    with pytest.raises(
        ConfigError,
        match=r"^rewards\[0\]\.name: expected a string, got 'r\.py' followed by a colon and nothing after it, which "
        r"YAML reads as a mapping; a plug-in reward is FILE\.py:FUNCTION \(e\.g\. my_rewards\.py:score\), or "
        r"quote the value$",
    ):
        load_config(None, ["rewards.0.name=r.py:"])
