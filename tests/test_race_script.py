"""scripts/race_objectives.py's validation mode (--split val): runs train on the training prompts less the
validation split with curves on it, the test split read once per run; the table's last column is the final weights'
test gain over the base model's."""

import json
from pathlib import Path

from repo_files import load_module

ROOT = Path(__file__).resolve().parents[1]


def race_module():
    return load_module("scripts/race_objectives.py", "race")


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


def test_a_validation_race_reports_the_test_split_once_per_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # where the race starts its runs: the data paths are relative to it
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
        ("dpo", 1, [0.30, 0.52, 0.44], 0.41),  # its best eval (+0.22, at 5 minutes) is not its last
        ("dpo", 2, [0.3, 0.3, 0.3], 0.3),
    ]
    for objective, seed, acc, test in runs:
        (results / f"{objective}-seed{seed}.json").write_text(json.dumps(fake_run(objective, seed, acc, test, race)))
    (results / "oot-base.json").write_text(json.dumps({race.HEADLINE: 0.06}))
    (results / "test-base.json").write_text(json.dumps({race.HEADLINE: 0.299}))
    import matplotlib.figure

    titles, save = [], matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):  # the plot's panels name the split its curves are on
        titles.extend(ax.get_title() for ax in fig.axes)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    argv = ["--split", "val", "--report", "--objectives", "dpo", "--seeds", "0", "1", "2"]
    assert race.main([*argv, "--results", str(results), "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "race.md").exists()  # the test-split race's table is left alone
    assert (tmp_path / "race-val.png").stat().st_size > 0 and titles[0] == "accuracy on the validation split"
    table = (tmp_path / "race-val.md").read_text().splitlines()
    assert "gain on val" in table[0] and table[0].endswith("test gain of the final weights, median (min - max) |")
    # val gains +0.22, +0.14, +0.00, best +0.22, +0.22, +0.00; +0.20 reached at 10, 5 minutes and never (the
    # median: 10); test gains 0.50 - 0.299 etc.: median +0.111 (+0.001 - +0.201)
    assert "best gain, median (min - max) | minutes to +0.20, median (each seed) |" in table[0]
    assert table[2].startswith(
        "| dpo | 3 | +0.140 (+0.000 - +0.220) | +0.220 (+0.000 - +0.220) | 10.0 (10.0, 5.0, -) |"
    )
    assert table[2].endswith("| +0.111 (+0.001 - +0.201) |")
    # every run on its line: seed 1's best (+0.22) came at 5 minutes, not its end; seed 2 never reached +0.20, its
    # best the first eval's (gain 0 at minute 0); TV and out-of-template at the end; test 0.41 - 0.299
    seeds = table[
        table.index(
            "| objective | seed | gain on val | best gain (minute) | minutes to +0.20 | colour TV "
            "| out-of-template | test gain |"
        )
        + 2 :
    ]
    assert seeds[:3] == [
        "| dpo | 0 | +0.220 | +0.220 (10.0) | 10.0 | 0.080 | 0.100 | +0.201 |",
        "| dpo | 1 | +0.140 | +0.220 (5.0) | 5.0 | 0.080 | 0.100 | +0.111 |",
        "| dpo | 2 | +0.000 | +0.000 (0.0) | - | 0.080 | 0.100 | +0.001 |",
    ]
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


def test_the_committed_validation_results_resume_in_any_checkout():
    """Each committed validation result holds the settings the race asks of it (its objective's and the validation
    data, relative to the repository), so a race resumed in another directory takes it instead of refusing it."""
    race = race_module()
    files = sorted((ROOT / "samples" / "shapes" / "race" / "val-runs").glob("*-seed*.json"))
    assert files
    for path in files:
        result = json.loads(path.read_text())
        assert result["settings"] == race.OBJECTIVE_SETTINGS[result["objective"]] + race.VAL_DATA, path.name
        assert f"{result['objective']}-seed{result['seed']}.json" == path.name


def test_the_frontier_lists_the_settings_nothing_beats_and_checks_the_demo_targets():
    """Every (objective, minutes) is a setting: each run stopped at its last eval by then. Hand-computed: objective
    a's seeds gain +0.20/+0.15 by minute 5 (TV 0.05 at most) and +0.34/+0.28 by minute 10 (TV 0.12 on seed 1);
    b's gain less with less drift."""
    race = race_module()

    def run(minutes, accuracy, tv):
        return {"curve": {"minutes": minutes, "accuracy": accuracy, "tv": tv}}

    results = {
        "a": [
            run([0, 5, 10], [0.30, 0.50, 0.64], [None, 0.05, 0.08]),
            run([0, 5, 10], [0.30, 0.45, 0.58], [None, 0.04, 0.12]),
        ],
        "b": [
            run([0, 4, 9], [0.30, 0.40, 0.42], [None, 0.02, 0.03]),
            run([0, 4, 9], [0.30, 0.35, 0.40], [0, 0.01, 0.02]),
        ],
    }
    a10 = next(s for s in race.settings_at(results) if (s["objective"], s["minutes"]) == ("a", 10.0))
    assert a10["seeds"] == 2 and abs(a10["median_gain"] - 0.31) < 1e-9 and abs(a10["min_gain"] - 0.28) < 1e-9
    assert a10["max_tv"] == 0.12
    front = [(s["objective"], s["minutes"]) for s in race.pareto(race.settings_at(results))]
    # 7.5 repeats 5's evals (more minutes, no better): beaten; a and b at 2.5 are the base, equal, both kept
    assert front == [("a", 2.5), ("b", 2.5), ("a", 5.0), ("b", 5.0), ("a", 10.0), ("b", 10.0)]
    lines = race.frontier(results, "val")
    assert "| a | 10 | 2 | +0.310 | +0.280 | 0.120 |" in lines
    assert any(line.startswith("No setting meets the demo's targets") for line in lines)
    assert lines[-1].startswith(
        "Within their colour TV and minutes, the best worst-seed gain is +0.150 (median +0.175): a at 5 min"
    )
    results["a"][1]["curve"]["tv"][2] = 0.09  # now a at 10 minutes meets every target
    lines = race.frontier(results, "val")
    assert any(line.endswith("are met by: a at 10 min.") for line in lines)  # 12.5 and 15: past 10 minutes
    assert lines[-1].endswith("+0.280 (median +0.310): a at 10 min, over 2 seeds.")


def test_a_run_cut_short_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    """train(): a run directory with checkpoints and no final row resumes (checkpoint.resume=auto, its log appended);
    one without a checkpoint starts afresh (log.overwrite=true); a finished one is not run. Each start says so."""
    race = race_module()
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)

    monkeypatch.setattr(race.subprocess, "run", fake_run)
    fresh = race.train(tmp_path, "dpo", 0, 15.0, 6, [])
    assert "log.overwrite=true" in calls[-1] and "checkpoint.resume=auto" not in calls[-1]
    (fresh / "ckpt-000010").mkdir()
    (fresh / "train.log").write_text("first part\n")
    race.train(tmp_path, "dpo", 0, 15.0, 6, [])
    assert "checkpoint.resume=auto" in calls[-1] and "log.overwrite=true" not in calls[-1]
    assert (fresh / "train.log").read_text() == "first part\n"  # appended to, not replaced
    (fresh / "metrics.jsonl").write_text(json.dumps({"epoch": 20, "final": True}) + "\n")
    race.train(tmp_path, "dpo", 0, 15.0, 6, [])
    assert len(calls) == 2
    said = [line.split(" race: ")[1] for line in capsys.readouterr().out.splitlines()]
    assert said == [
        f"dpo seed 0: training, 15 CPU-minutes (log: {fresh / 'train.log'})",
        f"dpo seed 0: resumed from its last checkpoint, 15 CPU-minutes (log: {fresh / 'train.log'})",
    ]


def test_curves_keep_each_family_and_old_results_are_refreshed_from_their_run(tmp_path):
    """curve() keeps each GenEval family's accuracy at each eval; a result written before it did takes them from
    its run directory (--refresh-curves), which must hold the same run; the report's family table is the median
    over seeds at the end, under the base's (hand-computed)."""
    race = race_module()
    run = tmp_path / "dpo-seed0"
    run.mkdir()
    fam = race.FAMILY
    rows = [
        {"epoch": 0, race.HEADLINE: 0.3, race.TV: None, f"{fam}counting": 0.2, f"{fam}position": 0.4},
        {"epoch": 1, "time/train_process_minutes": 2.0},
        {"epoch": 1, race.HEADLINE: 0.5, race.TV: 0.1, f"{fam}counting": 0.6, f"{fam}position": 0.4},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = race.curve(run)
    assert c["families"] == {"counting": [0.2, 0.6], "position": [0.4, 0.4]}
    assert c["minutes"] == [0.0, 2.0] and c["accuracy"] == [0.3, 0.5]
    old = {"objective": "dpo", "seed": 0, "curve": {k: c[k] for k in ("minutes", "accuracy", "tv", "epochs")}}
    assert race.refresh_curve(old, run)["curve"] == c
    assert race.refresh_curve(old, tmp_path / "missing") is None
    other = {**old, "curve": {**old["curve"], "accuracy": [0.3, 0.4]}}
    try:
        race.refresh_curve(other, run)
    except SystemExit as e:
        assert "holds another run" in str(e)
    else:
        raise AssertionError("a run directory of another run refreshed a result")

    def result(counting, position):
        return {"curve": {"families": {"counting": counting, "position": position}}}

    table = race.families_table(
        {
            "a": [result([0.2, 0.6], [0.4, 0.5]), result([0.2, 0.8], [0.4, 0.3]), result([0.2, 0.7], [0.4, 0.1])],
            "b": [result([0.2, 0.3], [0.4, 0.4])],
            "old": [{"curve": {"minutes": [0]}}],  # kept no families: left out
        }
    )
    assert table[2:] == [
        "| objective | counting | position |",
        "| --- | --- | --- |",
        "| base | 0.20 | 0.40 |",
        "| a (3) | 0.70 | 0.30 |",
        "| b (1) | 0.30 | 0.40 |",
    ]
    assert race.families_table({"old": [{"curve": {"minutes": [0]}}]}) == []


def write_metrics(directory, rows):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_paced_run_trains_pace_times_the_budget_and_reports_reference_minutes(tmp_path, monkeypatch):
    """--pace P: the run's budget is P x --minutes CPU-minutes, its curve's minutes are this machine's divided by P,
    and its result records P (a run at the reference pace records none); the per-seed table names the paced runs."""
    race = race_module()
    budgets = []

    def fake_train(out, objective, seed, minutes, eval_every, extra, epochs=100000):
        budgets.append(minutes)
        directory = race.run_dir(out, objective, seed)
        rows = [
            {"epoch": 0, race.HEADLINE: 0.3, race.TV: 0.0},
            {"epoch": 6, "time/train_process_minutes": 2.5},
            {"epoch": 6, race.HEADLINE: 0.5, race.TV: 0.05},
        ]
        write_metrics(directory, rows)
        (directory / "ckpt-000006").mkdir()
        return directory

    monkeypatch.setattr(race, "train", fake_train)
    monkeypatch.setattr(race, "evaluate", lambda *a, **k: {race.HEADLINE: 0.4})
    args = type("A", (), {"minutes": 15.0, "pace": 1.25, "split": "val", "extra": [], "eval_every": 6})
    results = tmp_path / "results"
    results.mkdir()
    paced = race.race_run(tmp_path / "out", results, "dpo", 0, args)
    assert budgets == [18.75]  # 15 x 1.25
    assert paced["pace"] == 1.25 and paced["minutes"] == 15.0  # the budget in reference minutes, as every run's
    assert paced["curve"]["minutes"] == [0.0, 2.0]  # 2.5 CPU-minutes here / 1.25
    args.pace = 1.0
    plain = race.race_run(tmp_path / "out", results, "dpo", 1, args)
    assert budgets[-1] == 15.0 and "pace" not in plain and plain["curve"]["minutes"] == [0.0, 2.5]
    # the refresh reads the run again at its own pace
    assert race.refresh_curve(paced, race.run_dir(tmp_path / "out", "dpo", 0))["curve"] == paced["curve"]
    table = race.seeds_table({"dpo": [paced, plain]}, test_base=0.3)
    assert table[-1].startswith("Raced at another pace")
    assert table[-1].endswith(": dpo 0 (pace 1.25, 6 epochs; at the reference pace 6-6).")
    assert not race.seeds_table({"dpo": [plain]}, test_base=0.3)[-1].startswith("Raced at")
    try:
        race.main(["--report", "--pace", "0", "--out", str(tmp_path / "o"), "--results", str(results)])
    except SystemExit as e:
        assert "--pace must be a positive number" in str(e)
    else:
        raise AssertionError("a pace of 0 was taken")


def test_the_pace_is_the_median_ratio_of_the_reference_runs_repeated_here(tmp_path, monkeypatch, capsys):
    """--calibrate-pace trains each committed reference-objective run at the reference pace again up to its first
    eval after the start and divides the CPU minutes here by the committed ones: the median over seeds. A paced
    result is not a reference; a repeat that does not reach the committed accuracy (not the same work) is refused."""
    race = race_module()
    results = tmp_path / "results"
    results.mkdir()
    obj = race.PACE_REFERENCE
    committed = {0: 1.0, 1: 1.2, 2: 0.8, 3: 5.0}  # seed 3 ran paced: not a reference
    for seed, minutes in committed.items():
        r = fake_run(obj, seed, [0.3, 0.31 + seed / 100, 0.4], 0.4, race)
        r["curve"]["minutes"] = [0.0, minutes, 2 * minutes]
        r["curve"]["epochs"] = [0, 6, 12]
        if seed == 3:
            r["pace"] = 2.0
        (results / f"{obj}-seed{seed}.json").write_text(json.dumps(r))
    here = {0: 1.3, 1: 1.2, 2: 1.2, 3: 1.0}  # ratios 1.3, 1.0, 1.5: the median 1.3
    trained = []
    wrong = set()

    def fake_train(out, objective, seed, minutes, eval_every, extra, epochs=100000):
        trained.append((objective, seed, epochs, eval_every))
        directory = race.run_dir(out, objective, seed)
        accuracy = 0.31 + seed / 100 + (0.01 if seed in wrong else 0.0)
        rows = [
            {"epoch": 0, race.HEADLINE: 0.3},
            {"epoch": 6, "time/train_process_minutes": here[seed]},
            {"epoch": 6, race.HEADLINE: accuracy},
        ]
        write_metrics(directory, rows)
        return directory

    monkeypatch.setattr(race, "train", fake_train)
    argv = ["--split", "val", "--calibrate-pace", "--jobs", "1", "--out", str(tmp_path / "o")]
    assert race.main([*argv, "--results", str(results)]) == 0
    assert sorted(trained) == [(obj, s, 6, 6) for s in (0, 1, 2)]
    said = capsys.readouterr().out
    assert "pace 1.300 (the median of 3)" in said and "--pace 1.300" in said
    assert abs(race.calibrate_pace(race_args(race, argv, results)) - 1.3) < 1e-12
    wrong.add(1)
    try:
        race.calibrate_pace(race_args(race, argv, results))
    except SystemExit as e:
        assert "did not repeat" in str(e) and "seed 1" in str(e)
    else:
        raise AssertionError("a repeat on another trajectory calibrated the pace")


def race_args(race, argv, results):
    """The namespace race.main would build (its defaults) for argv."""
    args = type("A", (), {})()
    args.results, args.out, args.split, args.extra, args.jobs = results, Path(argv[-1]), "val", [], 1
    return args
