"""`data.balance_by`: training prompts drawn so that every value of a column comes up equally often."""

import collections

import pytest

from flowrl.data import PromptSet

# a lopsided set, like the shapes world's (56 of its 94 training prompts are colour attribution)
PROMPTS = [f"a{i}" for i in range(7)] + ["b0", "b1"] + ["c0"]
META = [{"family": "a"}] * 7 + [{"family": "b"}] * 2 + [{"family": "c"}]
SET = PromptSet(PROMPTS, [dict(m) for m in META])


def _all_draws(n, epochs, seed=0, column="family"):
    return [p for e in range(epochs) for p in SET.draw(n, e, seed, column)[0]]


def test_every_value_equally_often_in_each_round_across_epochs():
    draws = _all_draws(n=4, epochs=6)  # 24 draws = 8 rounds of the 3 values; epochs cut rounds anywhere
    for r in range(8):
        assert sorted(p[0] for p in draws[3 * r : 3 * r + 3]) == ["a", "b", "c"]
    counts = collections.Counter(p[0] for p in draws)
    assert counts == {"a": 8, "b": 8, "c": 8}
    # unbalanced, the same 24 draws follow the set's proportions (7:2:1 over 10 prompts)
    plain = [p for e in range(6) for p in SET.draw(4, e, 0)[0]]
    assert collections.Counter(p[0] for p in plain)["a"] > 12


def test_each_value_walks_all_its_prompts_before_repeating_one():
    draws = _all_draws(n=3, epochs=14)  # 14 draws of each value
    a = [p for p in draws if p[0] == "a"]
    assert sorted(a[:7]) == sorted(a[7:14]) == [f"a{i}" for i in range(7)]
    b = [p for p in draws if p[0] == "b"]
    assert all(sorted(b[k : k + 2]) == ["b0", "b1"] for k in range(0, 14, 2))


def test_draws_are_seeded_and_metadata_travels_with_the_prompt():
    assert _all_draws(4, 5, seed=3) == _all_draws(4, 5, seed=3)
    assert _all_draws(4, 5, seed=3) != _all_draws(4, 5, seed=4)
    prompts, meta = SET.draw(5, 2, 0, "family")
    assert [m["family"] for m in meta] == [p[0] for p in prompts]


def test_an_unknown_column_names_the_columns_there_are():
    with pytest.raises(ValueError, match=r"by 'task'.*columns are \['family'\]"):
        SET.draw(2, 0, 0, "task")
    with pytest.raises(ValueError, match=r"a \.txt prompt file"):
        PromptSet(["x", "y"]).draw(1, 0, 0, "family")


def test_trainer_refuses_a_balance_column_at_start_up(tmp_path):
    from flowrl.config import load_config
    from flowrl.train import Trainer

    cfg = load_config(None, ["model.path=tiny-sd3", f"log.run_dir={tmp_path}", "data.balance_by=family"])
    with pytest.raises(ValueError, match="cannot balance prompts by 'family'"):
        Trainer(cfg)
    # eval.group_by is checked the same way, on the eval prompts (the built-in ones have no columns)
    cfg = load_config(None, ["model.path=tiny-sd3", f"log.run_dir={tmp_path}", "eval.group_by=family"])
    with pytest.raises(ValueError, match=r"eval.group_by='family': prompt 0 has no column 'family'.*plain-text"):
        Trainer(cfg)


def test_the_trainer_rolls_out_balanced_prompts(tmp_path):
    import json

    from flowrl.config import load_config
    from flowrl.train import Trainer

    rows = [{"prompt": f"a red circle {i}", "family": "big"} for i in range(6)] + [
        {"prompt": "a blue square", "family": "small"}
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(
        None,
        [
            "model.path=tiny-sd3",
            f"log.run_dir={tmp_path / 'run'}",
            "model.device=cpu",
            "sample.height=32",
            "sample.width=32",
            "sample.num_steps=2",
            "sample.group_size=2",
            "sample.prompts_per_epoch=2",
            "sample.max_sequence_length=16",
            "log.progress=false",
            f"data.train_prompts={path}",
            "data.balance_by=family",
        ],
    )
    tr = Trainer(cfg)
    for epoch in range(3):  # one prompt of each family per epoch: the single "small" prompt every time
        batch = tr.rollout(epoch)
        assert sorted(m["family"] for m in batch.metadata) == ["big", "big", "small", "small"]
        assert batch.prompts.count("a blue square") == 2


def test_the_error_says_how_to_turn_balancing_off(tmp_path):
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, load_prompt_sets

    path = tmp_path / "mine.txt"  # a plain-text prompt file under a preset that balances by a column
    path.write_text("a red cat\na blue dog\n")
    mine = [f"data.train_prompts={path}", "sample.prompts_per_epoch=2", "eval.group_by=", "eval.images_per_group=0"]
    with pytest.raises(PreflightError, match=r"by 'family'.*; set data\.balance_by= \(or data\.balance_by=null\)"):
        load_prompt_sets(load_config("configs/shapes.yaml", mine))
    for off in ("data.balance_by=", "data.balance_by=null", "data.balance_by=none"):
        cfg = load_config("configs/shapes.yaml", [*mine, off])
        assert cfg.data.balance_by == ""
        train, _ = load_prompt_sets(cfg)
        assert len(train) == 2


def test_a_prompt_file_without_the_column_is_named_by_file_and_line(tmp_path, no_model_load):
    """data.balance_by and eval.group_by over a .txt prompt file: the error names the file's first line (not
    "prompt 0") and how to turn the option off, before the model loads."""
    from flowrl.config import load_config
    from flowrl.preflight import load_prompt_sets

    prompts = tmp_path / "mine.txt"
    prompts.write_text("\n\na red circle\na blue square\n")
    cfg = load_config(None, ["model.path=tiny-sd3", f"data.train_prompts={prompts}", "data.balance_by=family"])
    with pytest.raises(ValueError, match=rf"'family': {prompts}:3 has no column 'family'.*data\.balance_by="):
        load_prompt_sets(cfg)
    cfg = load_config(None, ["model.path=tiny-sd3", f"data.eval_prompts={prompts}", "eval.group_by=family"])
    with pytest.raises(ValueError, match=rf"eval.group_by='family': {prompts}:3 has no column.*set eval\.group_by="):
        load_prompt_sets(cfg)
    with pytest.raises(ValueError, match=r"every image$"):  # nothing more to undo
        load_prompt_sets(cfg)
    # a share of images per group (as the shapes demo's): the one line names both keys to change
    cfg = load_config(
        None,
        ["model.path=tiny-sd3", f"data.eval_prompts={prompts}", "eval.group_by=family", "eval.images_per_group=192"],
    )
    with pytest.raises(
        ValueError,
        match=r"eval\.group_by=null\) to average over every image, with "
        r"eval\.images_per_group=0 \(it is 192, a share of each group\)$",
    ):
        load_prompt_sets(cfg)
