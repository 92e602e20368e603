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
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, ConfigWarning) and "prompts_per_epoch" in str(w.message)
    ]


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


def _held_out_warnings(tmp_path, train: list[str], evals: list[str] | None, *extra) -> list[str]:
    (tmp_path / "train.txt").write_text("".join(f"{line}\n" for line in train))
    args = [f"data.train_prompts={tmp_path / 'train.txt'}", "sample.prompts_per_epoch=1", *extra]
    if evals is not None:
        (tmp_path / "eval.txt").write_text("".join(f"{line}\n" for line in evals))
        args.append(f"data.eval_prompts={tmp_path / 'eval.txt'}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_prompt_sets(load_config(None, args))
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_an_eval_that_is_not_held_out_is_said_before_the_model_loads(tmp_path):
    """No data.eval_prompts: the eval samples the training prompts; eval prompts that are training prompts too: how
    many of how many, and the first with its line. Held-out eval prompts: nothing."""
    (message,) = _held_out_warnings(tmp_path, ["a cat", "a dog"], None)
    assert message.startswith("data.eval_prompts is not set: the eval before and after training samples the training")
    (message,) = _held_out_warnings(tmp_path, ["a cat", "a dog", "a cow"], ["a bird", "a dog", "a cow", "a dog"])
    assert message.startswith("data.eval_prompts: 2 of its 3 distinct prompts are training prompts too (the first: ")
    assert f"'a dog', {tmp_path / 'eval.txt'}:2)" in message and "not held out for them" in message
    assert _held_out_warnings(tmp_path, ["a cat", "a dog"], ["a bird", "a cow"]) == []


def test_an_edit_prompt_with_other_images_is_held_out(tmp_path):
    """With conditioning images (data.image_column), a prompt is the text and its images: the same instruction on
    another image is a held-out prompt."""
    import json

    from PIL import Image

    for name in ("a.png", "b.png"):
        Image.new("RGB", (16, 16)).save(tmp_path / name)

    def rows(path, items):
        path.write_text("".join(json.dumps({"prompt": p, "image": str(tmp_path / i)}) + "\n" for p, i in items))

    rows(tmp_path / "train.jsonl", [("make it red", "a.png")])
    rows(tmp_path / "other.jsonl", [("make it red", "b.png")])
    rows(tmp_path / "same.jsonl", [("make it red", "a.png")])
    base = [f"data.train_prompts={tmp_path / 'train.jsonl'}", "sample.prompts_per_epoch=1", "data.image_column=image"]

    def seen(evals):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_prompt_sets(load_config(None, [*base, f"data.eval_prompts={evals}"]))
        return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]

    assert seen(tmp_path / "other.jsonl") == []
    (message,) = seen(tmp_path / "same.jsonl")
    assert "1 of its 1 distinct prompts are training prompts too (the first: 'make it red'" in message
