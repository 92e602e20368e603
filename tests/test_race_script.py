"""scripts/race_objectives.py's validation mode (--split val): runs train on the training prompts less the
validation split with curves on it, the test split read once per run; the table's last column is the final weights'
test gain over the base model's."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def race_module():
    spec = importlib.util.spec_from_file_location("race", ROOT / "scripts" / "race_objectives.py")
    race = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(race)
    return race


def fake_run(objective, seed, accuracy, test_after, race):
    return {
        "objective": objective,
        "seed": seed,
        "settings": race.OBJECTIVE_SETTINGS[objective] + race.VAL_DATA,
        "minutes": 15.0,
        "curve": {"minutes": [0.0, 5.0, 10.0], "accuracy": accuracy, "tv": [0.0, 0.05, 0.08], "epochs": [0, 5, 10]},
        "oot_after": 0.1,
        "test_after": test_after,
    }


def test_a_validation_race_reports_the_test_split_once_per_run(tmp_path):
    race = race_module()
    # the validation race's data exist, and its eval plan is valid (56 images per family on the val split)
    from flowrl.config import load_config
    from flowrl.data import load_prompts
    from flowrl.eval.summary import eval_plan

    cfg = load_config(race.CONFIG, race.VAL_DATA + race.EVAL)
    prompts, meta, _ = eval_plan(load_prompts(cfg.data.eval_prompts), cfg.eval)
    assert {m["split"] for m in meta} == {"val"} and len(prompts) == 56 * 6
    assert race.split_data(type("A", (), {"split": "val"})) == race.VAL_DATA
    assert race.split_data(type("A", (), {"split": "test"})) == []
    results = tmp_path / "val-runs"
    results.mkdir()
    runs = [
        ("dpo", 0, [0.30, 0.45, 0.52], 0.50),
        ("dpo", 1, [0.30, 0.40, 0.44], 0.41),
        ("dpo", 2, [0.3, 0.3, 0.3], 0.3),
    ]
    for objective, seed, acc, test in runs:
        (results / f"{objective}-seed{seed}.json").write_text(json.dumps(fake_run(objective, seed, acc, test, race)))
    (results / "oot-base.json").write_text(json.dumps({race.HEADLINE: 0.06}))
    (results / "test-base.json").write_text(json.dumps({race.HEADLINE: 0.299}))
    argv = ["--split", "val", "--report", "--objectives", "dpo", "--seeds", "0", "1", "2"]
    assert race.main([*argv, "--results", str(results), "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "race.md").exists()  # the test-split race's table is left alone
    table = (tmp_path / "race-val.md").read_text().splitlines()
    assert "gain on val" in table[0] and table[0].endswith("test gain of the final weights, median (min - max) |")
    # val gains +0.22, +0.14, +0.00; test gains 0.50 - 0.299 etc.: median +0.111 (+0.001 - +0.201)
    assert "| dpo | 3 | +0.140 (+0.000 - +0.220) |" in table[2]
    assert table[2].endswith("| +0.111 (+0.001 - +0.201) |")
    # a result raced without the validation data is refused, not mixed in
    mixed = fake_run("dpo", 3, [0.3, 0.4, 0.5], 0.4, race)
    mixed["settings"] = race.OBJECTIVE_SETTINGS["dpo"]
    (results / "dpo-seed3.json").write_text(json.dumps(mixed))
    try:
        race.main([*argv[:-3], "3", "--results", str(results), "--out", str(tmp_path / "out"), "--jobs", "1"])
    except SystemExit as e:
        assert "was raced with other settings" in str(e)
    else:
        raise AssertionError("a result of another split was mixed in")
