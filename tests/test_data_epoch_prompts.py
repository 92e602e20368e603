"""sample.prompts_per_epoch against the number of training prompts: more prompts per epoch than the set holds
draws some twice in every epoch, each time as a separate group; a warning before the model loads says so."""

import warnings

from flowrl.config import ConfigWarning, describe, load_config
from flowrl.data import PromptSet
from flowrl.preflight import load_prompt_sets


def _repeat_warnings(tmp_path, lines: list[str], per_epoch: int) -> list[str]:
    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    cfg = load_config(None, [f"data.train_prompts={path}", f"sample.prompts_per_epoch={per_epoch}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_prompt_sets(cfg)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_more_prompts_per_epoch_than_distinct_prompts_warns_with_the_numbers(tmp_path):
    (message,) = _repeat_warnings(tmp_path, ["a cat", "a dog", "a cat"], per_epoch=3)  # 2 distinct
    assert message.startswith("sample.prompts_per_epoch=3 but data.train_prompts has 2 distinct prompts")
    assert "more than once, each time as a separate group" in message
    assert "sample.prompts_per_epoch=2 or less" in message
    assert _repeat_warnings(tmp_path, ["a cat", "a dog"], per_epoch=2) == []


def test_the_draw_does_what_the_warning_and_the_help_say():
    prompts, _ = PromptSet(["a", "b"]).draw(4, 0, seed=0)  # 4 draws of 2 prompts: each twice, as 4 groups
    assert sorted(prompts) == ["a", "a", "b", "b"]
    doc = next(row[3] for row in describe() if row[0] == "sample.prompts_per_epoch")
    assert not doc.startswith("Distinct prompts") and "each time as a separate group" in doc
