"""Run-directory plots."""

import json
import re

import pytest
from PIL import Image

from flowrl.run.report import (
    Curve,
    curves_figure,
    headline_eval_keys,
    load_metrics,
    plot_curves,
    result_keys,
    scale_groups,
    write_before_after,
)


def test_plot_curves_writes_a_png(tmp_path):
    rows = [{"epoch": 0, "eval/accuracy_mean": 0.5}]
    rows += [{"epoch": e, "reward/total_mean": 0.2 + 0.01 * e} for e in range(1, 30)]
    rows += [{"epoch": 30, "eval/accuracy_mean": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_curves(tmp_path)
    assert out == tmp_path / "curves.png"
    with Image.open(out) as im:
        assert im.size[0] > 500 and im.size[1] > 200


def test_plot_curves_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_curves(tmp_path)


def test_plot_leaves_out_per_group_breakdowns():
    rows = [
        {
            "epoch": 0,
            "eval/g_mean": 0.4,
            "eval/g/strict_mean": 0.2,
            "eval/g/strict_family_mean": 0.3,
            "eval/g/strict_by_family/colors": 0.9,
            "eval/g_by_family/position": 0.1,
        },
        {"epoch": 1, "reward/total_mean": 0.5},
    ]
    assert headline_eval_keys(rows) == ["eval/g/strict_family_mean", "eval/g/strict_mean", "eval/g_mean"]


def test_the_diversity_metrics_are_drawn_and_their_counts_are_not():
    """The colour TV and the feature-space diversity (spread, its ratio to the base's, distance from the base's)
    each get a line; the colour counts stay in metrics.jsonl."""
    feats = "eval/diversity/features/"
    rows = [
        {
            "epoch": e,
            "reward/total_mean": 0.1 * e,
            "eval/g_mean": 0.3 + 0.1 * e,
            "eval/diversity/g/color_tv_from_base": 0.1 * e,
            "eval/diversity/g/color_count": 40.0,
            feats + "spread": 0.4 - 0.05 * e,
            feats + "spread_from_base": 1.0 - 0.1 * e,
            feats + "distance_from_base": 0.002 * e,
        }
        for e in range(3)
    ]
    drawn = {label for axes in lines_of(curves_figure(rows))[1:] for label, _, _ in axes}
    assert drawn == {
        "g_mean",
        "diversity/g/color_tv_from_base",
        "diversity/features/spread",
        "diversity/features/spread_from_base",
        "diversity/features/distance_from_base",
    }


def test_an_eval_key_without_numbers_draws_no_empty_legend(tmp_path):
    """An eval column with no numeric value (here a text sample) gives no line, so no legend and no warning."""
    import warnings

    rows = [{"epoch": 0, "eval/sample_text": "a red circle"}]
    rows += [{"epoch": e, "reward/total_mean": 0.1 * e} for e in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_curves(tmp_path).exists()


def test_result_keys_put_the_grouped_strict_mean_first_and_skip_what_was_not_logged():
    rows = [
        {
            "epoch": 0,
            "eval/g_mean": 0.4,
            "eval/g/strict_mean": 0.2,
            "eval/g/strict_family_mean": 0.3,
            "eval/g_family_mean": 0.35,
        },
        {"epoch": 1, "reward/total_mean": 0.5},
    ]
    assert result_keys(rows, "g", "family") == [
        "eval/g/strict_family_mean",
        "eval/g_family_mean",
        "eval/g/strict_mean",
        "eval/g_mean",
    ]
    assert result_keys(rows, "g") == ["eval/g/strict_mean", "eval/g_mean"]
    assert result_keys([{"epoch": 0, "eval/h_mean": 0.1}], "h", "family") == ["eval/h_mean"]
    assert result_keys(rows, "other") == []


def test_before_after_is_captioned_with_the_headline_and_needs_both_grids(tmp_path):
    rows = [{"epoch": 0, "eval/g_mean": 0.25}, {"epoch": 5, "eval/g_mean": 0.5, "final": True}]
    Image.new("RGB", (40, 30), (255, 0, 0)).save(tmp_path / "eval-epoch000000.png")
    assert write_before_after(tmp_path, rows, "eval/g_mean") is None  # no final grid (a text run, or eval.grid off)
    Image.new("RGB", (40, 30), (0, 0, 255)).save(tmp_path / "eval-final.png")
    out = write_before_after(tmp_path, rows, "eval/g_mean")
    assert out == tmp_path / "before_after.png"
    with Image.open(out) as im:
        im = im.convert("RGB")
        assert im.width > 80 and im.height > 30
        # the first grid on the left, the final one on the right, below the caption strip
        assert im.getpixel((10, im.height - 10)) == (255, 0, 0)
        assert im.getpixel((im.width - 10, im.height - 10)) == (0, 0, 255)


# ----------------------------------------------------------------------- one line per series, one point per epoch


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def geneval_eval(epoch, strict, fraction):
    """An eval row as the trainer logs it with eval.group_by=family on a balanced eval set: the family means equal
    the plain means, and the shapes reward's own value is its strict component."""
    row = {
        "epoch": epoch,
        "time": 1.0,
        "eval/g_mean": strict,
        "eval/g_family_mean": strict,
        "eval/g/strict_mean": strict,
        "eval/g/strict_family_mean": strict,
        "eval/g/fraction_mean": fraction,
        "eval/g/fraction_family_mean": fraction,
    }
    for family in ("colors", "counting"):
        row[f"eval/g_by_family/{family}"] = strict
        row[f"eval/g/strict_by_family/{family}"] = strict
    return row


def resumed_run_rows():
    """Eval before; epochs 1-6 with an eval at 4; a crash after 6 and a resume from the checkpoint at 4, so epochs
    5 and 6 are logged twice (with other values); epochs to 8; the final eval at 8, beside the last training row."""
    rows = [geneval_eval(0, 0.25, 0.5)]
    for e in range(1, 7):
        rows.append({"epoch": e, "time": 1.0, "reward/total_mean": 0.1 * e, "reward/g_mean": 0.1 * e})
    rows[4].update({k: v for k, v in geneval_eval(4, 0.3, 0.55).items() if k != "epoch"})
    for e in range(5, 9):
        rows.append({"epoch": e, "time": 2.0, "reward/total_mean": 0.1 * e + 0.05, "reward/g_mean": 0.1 * e + 0.05})
    rows.append({**geneval_eval(8, 0.5, 0.7), "final": True})
    return rows


def lines_of(fig):
    """[(label, xs, ys) of every line] of each axes, in order."""
    return [
        [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]
        for ax in fig.axes
    ]


def test_a_resumed_run_draws_one_point_per_epoch_the_last_logged_winning():
    reward_axes, *eval_axes = lines_of(curves_figure(resumed_run_rows()))
    batch = {label: (x, y) for label, x, y in reward_axes}["batch mean"]
    assert batch[0] == [1, 2, 3, 4, 5, 6, 7, 8]  # 5 and 6 once each; the final eval row takes no point from 8
    assert batch[1][4:6] == pytest.approx([0.55, 0.65])  # the resumed run's values, logged last
    for axes in eval_axes:
        for label, x, y in axes:
            assert x == [0, 4, 8], label


def test_equal_eval_series_are_one_line_with_every_name_in_its_label():
    (eval_axes,) = lines_of(curves_figure(resumed_run_rows()))[1:]
    labels = [label for label, _, _ in eval_axes]
    assert len(eval_axes) == 2  # strict (= the reward's value, = their family means) and fraction
    strict = next(label for label in labels if "g/strict_mean" in label)
    assert all(name in strict for name in ("g_mean", "g_family_mean", "g/strict_family_mean"))
    assert "by_family" not in " ".join(labels)


def test_eval_series_of_different_scales_get_their_own_axes():
    rows = [
        {
            "epoch": e,
            "reward/total_mean": 0.1 * e,
            "eval/acc_mean": 0.2 + 0.1 * e,
            "eval/acc/format_mean": 0.9,
            "eval/pickscore_mean": 21.5 + 0.1 * e,
            "eval/loss_mean": 1e-3 * (3 - e),
        }
        for e in range(3)
    ]
    fig = curves_figure(rows)
    groups = sorted(sorted(label for label, _, _ in axes) for axes in lines_of(fig)[1:])
    assert groups == [["acc/format_mean", "acc_mean"], ["loss_mean"], ["pickscore_mean"]]
    assert len(fig.axes) == 4  # the training reward, then one axes per scale


def test_scale_groups_are_decided_from_the_values():
    def curve(name, *values):
        return Curve([name], list(range(len(values))), list(values))

    small, unit, zero, big = curve("s", 0.002, 0.001), curve("u", 0.3, 0.9), curve("z", 0.0, 0.0), curve("b", 22, 23)
    assert scale_groups([unit, big, small, zero]) == [[unit], [big], [small, zero]]  # zeros join the smallest scale
    assert scale_groups([curve("a", 0.1), curve("b", 0.9)], ratio=10) != scale_groups(
        [curve("a", 0.05), curve("b", 0.9)], ratio=10
    )  # 9x apart share axes, 18x apart do not


# ------------------------------------------------------------------------------ clear errors on what is not a run


def test_a_missing_run_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere is not a run directory: it does not exist") as err:
        plot_curves(tmp_path / "nowhere")
    assert "\n" not in str(err.value)


def test_a_directory_without_metrics_says_what_writes_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a run directory: no metrics.jsonl \(a run writes it after"):
        plot_curves(tmp_path)


def test_the_metrics_file_itself_points_to_its_directory(tmp_path):
    write_metrics(tmp_path, [{"epoch": 1, "reward/total_mean": 0.5}])
    with pytest.raises(FileNotFoundError, match=re.escape(f"pass the directory that holds metrics.jsonl ({tmp_path})")):
        plot_curves(tmp_path / "metrics.jsonl")


def test_an_empty_metrics_file_is_a_value_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'metrics.jsonl'} is empty")):
        plot_curves(tmp_path)


@pytest.mark.parametrize(
    "bad",
    [
        '{"epoch": 2, "reward/total_mean": 0.',
        "[1, 2]",
        '{"reward/total_mean": 1}',
        '{"epoch": true}',
        b'\xff\xfe{"epoch": 2}',
    ],
)
def test_a_corrupt_line_is_named_by_file_and_line(tmp_path, bad):
    good = json.dumps({"epoch": 1, "reward/total_mean": 0.5}).encode()
    (tmp_path / "metrics.jsonl").write_bytes(good + b"\n" + (bad if isinstance(bad, bytes) else bad.encode()) + b"\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'metrics.jsonl'}:2: ")) as err:
        plot_curves(tmp_path)
    assert "\n" not in str(err.value) and "delete or fix this line" in str(err.value)
    assert not (tmp_path / "curves.png").exists()


def test_a_last_line_cut_short_is_left_out_with_a_warning(tmp_path):
    """A crash, or a run writing its next line now, leaves the last line without its newline: the report is of the
    lines before it (a corrupt line inside the file, or one that ends with its newline, is still refused, above)."""
    rows = [json.dumps({"epoch": e, "reward/total_mean": 0.1 * e}) for e in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"epoch": 4, "reward/tot')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:4: the last line is cut short"):
        plot_curves(tmp_path)
    assert (tmp_path / "curves.png").stat().st_size > 0
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 4, "reward/tot')  # nothing before it: nothing to plot
    with pytest.raises(ValueError, match="metrics.jsonl:1: not valid JSON"):
        plot_curves(tmp_path)


def test_load_metrics_returns_the_rows_of_a_good_file(tmp_path):
    rows = resumed_run_rows()
    assert load_metrics(write_metrics(tmp_path, rows)) == rows


# ------------------------------------------------------------------------------------ several runs compared


def write_run(directory, rows):
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def sweep(tmp_path):
    """Two runs of a sweep, both named `run` in their own folder; b logs one eval metric more than a."""
    a = write_run(
        tmp_path / "lr1e-4" / "run",
        [
            {"epoch": 0, "eval/score_mean": 0.30},
            {"epoch": 1, "reward/total_mean": 0.2, "time/train_wall_minutes": 1.5, "time/train_process_minutes": 2.5},
            {"epoch": 2, "reward/total_mean": 0.4, "time/train_wall_minutes": 3.0, "time/train_process_minutes": 5.0},
            {"epoch": 2, "eval/score_mean": 0.45, "final": True},
        ],
    )
    b = write_run(
        tmp_path / "lr3e-4" / "run",
        [
            {"epoch": 0, "eval/score_mean": 0.30, "eval/other_mean": 1.0},
            {"epoch": 1, "reward/total_mean": 0.5, "time/train_wall_minutes": 2.0, "time/train_process_minutes": 1.0},
            {"epoch": 1, "eval/score_mean": 0.25, "eval/other_mean": 2.0, "final": True},
        ],
    )
    return a, b


def test_several_runs_are_compared_on_the_metrics_they_all_logged(tmp_path, capsys):
    from flowrl.cli import main

    a, b = sweep(tmp_path)
    out = tmp_path / "compare.png"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [  # named by as much of their paths as tells them apart; eval/other_mean only b logged
        "| run | epochs | training minutes (wall-clock) | score_mean |",
        "| --- | --- | --- | --- |",
        "| lr1e-4/run | 2 | 3.0 | 0.300 -> 0.450 (+0.150) |",
        "| lr3e-4/run | 1 | 2.0 | 0.300 -> 0.250 (-0.050) |",
        str(out),
    ]
    assert Image.open(out).size[0] > 2 * Image.open(out).size[1]  # the reward and one eval panel, side by side
    assert main(["report", str(a), str(b), "--out", str(out), "--x", "cpu_minutes"]) == 0
    assert "| lr1e-4/run | 2 | 5.0 |" in capsys.readouterr().out


def test_a_metric_not_every_run_logged_is_named_with_the_shared_ones(tmp_path, capsys):
    from flowrl.cli import main

    a, b = sweep(tmp_path)
    assert main(["report", str(a), str(b), "--metric", "other_mean"]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "flowrl report: --metric other_mean: not logged by every run; the eval metrics they all logged: score_mean"
    )
    assert main(["report", str(a), str(tmp_path / "missing")]) == 1
    assert "missing is not a run directory" in capsys.readouterr().err


def test_the_minutes_axis_places_each_eval_at_its_epochs_end():
    from flowrl.run.report import minutes_by_epoch

    rows = [
        {"epoch": 0, "eval/x": 1},
        {"epoch": 1, "time/train_wall_minutes": 1.5},
        {"epoch": 2, "time/train_wall_minutes": 3.25},
        {"epoch": 2, "eval/x": 2},
    ]
    assert minutes_by_epoch(rows) == {0: 0.0, 1: 1.5, 2: 3.25}
    assert minutes_by_epoch(rows, "time/train_process_minutes") == {0: 0.0}


def test_report_out_takes_its_format_from_its_suffix_and_makes_its_folder(tmp_path, capsys):
    """--out picks the figure's format by its suffix (a JPEG is a JPEG, not a PNG under another name), makes the
    folders it names, and a folder that cannot be made (under a file) or an unknown suffix is one line, before any
    run is read; nothing is left beside the figure."""
    from flowrl.cli import main

    a, b = sweep(tmp_path)
    for name, fmt in (("deep/er/curves.jpg", "JPEG"), ("c.webp", "WEBP"), ("c.png", "PNG")):
        assert main(["report", str(a), "--out", str(tmp_path / "out" / name)]) == 0
        with Image.open(tmp_path / "out" / name) as im:
            assert im.format == fmt and im.size[0] > 300
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "out" / "cmp.svg")]) == 0
    assert (tmp_path / "out" / "cmp.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["c.png", "c.webp", "cmp.svg", "deep"]
    # one run: --metric and --x (which pick what several runs are compared on) are said to be unused
    assert main(["report", str(a), "--out", str(tmp_path / "out" / "c.png"), "--x", "minutes", "--metric", "m"]) == 0
    assert "--metric and --x compare several runs; one run's figure shows all its curves" in capsys.readouterr().err
    # a folder that exists: the figure under its own name there (it was a traceback of a rename onto the folder)
    assert main(["report", str(a), "--out", str(tmp_path / "out" / "deep")]) == 0
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    with Image.open(tmp_path / "out" / "deep" / "curves.png") as im, Image.open(tmp_path / "out" / "compare.png") as c:
        assert im.format == c.format == "PNG"
    capsys.readouterr()
    (tmp_path / "afile").write_text("")
    assert main(["report", str(a), "--out", str(tmp_path / "afile" / "x.png")]) == 1
    err = capsys.readouterr().err.strip()
    under = tmp_path / "afile"
    assert err == (
        f"flowrl report: --out {under / 'x.png'}: its folder {under} cannot be written (it is a file, not a directory)"
    )
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "c.txt")]) == 2  # (a usage error)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flowrl report: --out {tmp_path / 'c.txt'}: a figure is written as .png") and "\n" not in err


def test_before_and_after_only_when_the_run_evaluated_before_training(tmp_path):
    """`flowrl train`'s summary compares the final eval with the eval before training (epoch 0); a run without
    one (eval.before=false) compares nothing, not its final eval with itself, nor with one after training began."""
    from flowrl.cli import before_after_lines
    from flowrl.run.report import eval_before_training

    def write(rows):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    final = {"epoch": 4, "final": True, "eval/r_mean": 0.75}
    rows = write([{"epoch": 0, "eval/r_mean": 0.5}, {"epoch": 2, "loss": 1.0}, final])
    assert eval_before_training(rows) == rows[0]
    assert before_after_lines(tmp_path, final) == ["eval/r_mean: before 0.5000 -> after 0.7500 (+0.250)"]
    for rows in ([{"epoch": 2, "eval/r_mean": 0.6}, final], [final]):  # eval.every=2 / only the final eval
        assert eval_before_training(write(rows)) is None and before_after_lines(tmp_path, final) == []
