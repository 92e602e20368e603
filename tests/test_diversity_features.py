"""Feature-space diversity (eval.diversity_features): the spread of each prompt's images and the energy distance from
the base model's images, computed by hand on small unit vectors; the config and preflight checks; and a tiny SD3 run
with a tiny random DINOv2 that logs them against the base written by its first eval, and reads that base on resume."""

import json
import math
from pathlib import Path

import pytest
import torch
from imagetiny import TINY_RUN

from flowrl.config import ConfigError, load_config
from flowrl.eval.diversity import (
    BaseFeatures,
    energy_distance,
    feature_metrics,
    feature_spread,
    group_features,
    prompt_keys,
)
from flowrl.preflight import PreflightError, check_eval_features, load_prompt_sets

SPREAD, RATIO, DISTANCE = (f"eval/diversity/features/{k}" for k in ("spread", "spread_from_base", "distance_from_base"))


def unit(*angles_deg: float) -> torch.Tensor:
    """[n, 2] unit vectors at the given angles."""
    a = torch.tensor(angles_deg, dtype=torch.float64) * math.pi / 180
    return torch.stack([a.cos(), a.sin()], 1).float()


def random_unit(n: int, d: int, seed: int) -> torch.Tensor:
    f = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return f / f.norm(dim=-1, keepdim=True)


# ------------------------------------------------------------------------------------------ the formulas by hand


def test_feature_spread_is_the_mean_cosine_distance_over_the_pairs():
    # axes: d(e1, e2) = 1, d(e1, -e1) = 2, d(e2, -e1) = 1 -> 4/3
    assert feature_spread(unit(0, 90, 180)) == pytest.approx(4 / 3, abs=1e-6)
    # 0, 60, 120 degrees: cos 0.5, -0.5, 0.5 -> distances 0.5, 1.5, 0.5 -> 2.5/3
    assert feature_spread(unit(0, 60, 120)) == pytest.approx(2.5 / 3, abs=1e-6)
    assert feature_spread(unit(30, 30, 30, 30)) == pytest.approx(0.0, abs=1e-6)  # identical images
    assert feature_spread(unit(0, 180)) == pytest.approx(2.0, abs=1e-6)  # opposite: the largest


def test_feature_spread_needs_two_images():
    with pytest.raises(ValueError, match="n >= 2"):
        feature_spread(unit(0))


def test_energy_distance_by_hand():
    # Euclidean d: |e1 - e2| = sqrt(2), |e1 - (-e1)| = 2.
    # f = {e1, e2}, g = {e1, e1}: E d(f, g) = (0 + 0 + r2 + r2) / 4 = r2/2; E d(f, f') = (0 + r2 + r2 + 0) / 4 = r2/2
    # (the V form: self-pairs included); E d(g, g') = 0 -> 2 r2/2 - r2/2 - 0 = r2/2
    r2 = math.sqrt(2)
    assert energy_distance(unit(0, 90), unit(0, 0)) == pytest.approx(r2 / 2, abs=1e-6)
    # sets of different sizes: f = {e1}, g = {e2, -e1}: E d(f, g) = (r2 + 2) / 2; within f 0; within g
    # (0 + r2 + r2 + 0) / 4 = r2/2 -> r2 + 2 - r2/2 = 2 + r2/2
    assert energy_distance(unit(0), unit(90, 180)) == pytest.approx(2 + r2 / 2, abs=1e-6)
    assert energy_distance(unit(90, 180), unit(0)) == pytest.approx(2 + r2 / 2, abs=1e-6)  # symmetric


def test_energy_distance_sees_a_change_that_keeps_the_mean_feature():
    """{e1, -e1} and {e2, -e2} have the same mean feature (0): a cosine-distance energy distance, |mean f - mean g|^2,
    is 0 for them; the Euclidean one is 2 E d(f, g) - E d(f, f') - E d(g, g') = 2 r2 - 1 - 1 (every cross pair
    sqrt(2) apart; within each set (0 + 2 + 2 + 0) / 4 = 1)."""
    f, g = unit(0, 180), unit(90, 270)
    assert float((f.double().mean(0) - g.double().mean(0)).pow(2).sum()) == pytest.approx(0.0, abs=1e-12)
    assert energy_distance(f, g) == pytest.approx(2 * math.sqrt(2) - 2, abs=1e-6)
    # and it does not depend on rounding near 0: two sets that differ by 1e-6 are about that far apart, not
    # sqrt(rounding of 1 - <x, y>) ~ 3e-4
    a = random_unit(4, 8, 7)
    b = a + 1e-6 * random_unit(4, 8, 8)
    assert 0 < energy_distance(a, b / b.norm(dim=-1, keepdim=True)) < 1e-5


def test_energy_distance_of_a_set_with_itself_is_zero_and_grows_as_one_set_moves():
    f = random_unit(6, 16, 2)
    assert energy_distance(f, f) == 0.0
    assert energy_distance(f, f.clone()) == 0.0
    direction = random_unit(1, 16, 3)
    moved = []
    for t in (0.0, 0.2, 0.5, 1.0, 3.0):
        g = f + t * direction
        moved.append(energy_distance(f, g / g.norm(dim=-1, keepdim=True)))
    assert moved[0] == pytest.approx(0.0, abs=1e-6)  # f renormalised in float32: a rounding-sized move
    assert all(a < b for a, b in zip(moved, moved[1:])), moved
    # two independent draws of one distribution: near 0 (within a few 1/n), far below a moved set's
    a, b = random_unit(400, 16, 4), random_unit(400, 16, 5)
    assert energy_distance(a, b) < 0.01 < moved[-1]


def test_energy_distance_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="same D"):
        energy_distance(random_unit(2, 4, 0), random_unit(2, 5, 0))


def test_feature_metrics_average_over_prompts_and_compare_only_the_prompts_the_base_holds():
    groups = {"a": unit(0, 90, 180), "b": unit(0, 60, 120), "c": unit(10, 10)}
    base = {"a": unit(0, 180), "b": unit(0, 90), "gone": unit(5, 6)}
    m = feature_metrics(groups, base)
    assert m[SPREAD] == pytest.approx((4 / 3 + 2.5 / 3 + 0.0) / 3, abs=1e-6)
    # a and b only (c is not in the base): (4/3 + 2.5/3) / (2 + 1)
    assert m[RATIO] == pytest.approx((4 / 3 + 2.5 / 3) / 3, abs=1e-6)
    expected = (energy_distance(groups["a"], base["a"]) + energy_distance(groups["b"], base["b"])) / 2
    assert m[DISTANCE] == pytest.approx(expected, rel=1e-9)
    # a: f = {0, 90, 180 deg}, g = {0, 180}: cross (0 + 2 + r2 + r2 + 2 + 0) / 6 = (4 + 2 r2) / 6; within f
    # (0 + r2 + 2 + r2 + 0 + r2 + 2 + r2 + 0) / 9 = (4 + 4 r2) / 9; within g (0 + 2 + 2 + 0) / 4 = 1
    r2 = math.sqrt(2)
    a = 2 * (4 + 2 * r2) / 6 - (4 + 4 * r2) / 9 - 1
    # b: f = {0, 60, 120 deg}, g = {0, 90}: chords 2 sin(angle / 2): 0, 60, 120 deg apart -> 0, 1, sqrt(3);
    # 30 and 90 deg -> 2 sin 15, r2; cross: to 0: 0, 1, r3; to 90: r2, 2 sin 15, 2 sin 15
    r3, s15 = math.sqrt(3), 2 * math.sin(math.pi / 12)
    b = 2 * (0 + 1 + r3 + r2 + 2 * s15) / 6 - 2 * (1 + r3 + 1) / 9 - 2 * r2 / 4
    assert m[DISTANCE] == pytest.approx((a + b) / 2, abs=1e-6)


def test_feature_metrics_against_themselves_are_exactly_one_and_zero():
    groups = {"a": random_unit(4, 8, 0), "b": random_unit(4, 8, 1)}
    m = feature_metrics(groups, groups)
    assert m[RATIO] == 1.0 and m[DISTANCE] == 0.0
    assert set(feature_metrics(groups)) == {SPREAD}  # no base: the spread alone


def test_a_base_of_identical_images_gives_no_ratio():
    m = feature_metrics({"a": unit(0, 90)}, {"a": unit(7, 7)})
    assert RATIO not in m and m[DISTANCE] > 0


def test_prompt_keys_group_repeated_listings_and_keep_metadata_apart():
    prompts = ["a cat", "a cat", "edit it", "edit it"]
    meta = [{"family": "x"}, {"family": "x"}, {"image": "1.png"}, {"image": "2.png"}]
    keys = prompt_keys(prompts, meta, 2)
    assert len(keys) == 8 and len(set(keys)) == 3  # the two listings of "a cat" are one prompt; the edits two
    features = torch.arange(8.0)[:, None]
    groups = group_features(features, keys)
    assert [g[:, 0].tolist() for g in groups.values()] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="3 features for 8"):
        group_features(features[:3], keys)


def test_base_features_round_trip_atomically(tmp_path):
    store = BaseFeatures(tmp_path)
    assert store.load() is None
    groups = {'["a", {}]': random_unit(2, 4, 0), '["b", {"k": "é"}]': random_unit(3, 4, 1)}
    assert store.settings() is None
    store.save(groups, "some/backbone")
    assert store.settings() is None  # saved without the eval's settings: none recorded
    store.save(groups, "some/backbone", {"eval.num_steps": 20, "prompts": "2 listed, sha256 0123"})
    assert store.settings() == {"eval.num_steps": 20, "prompts": "2 listed, sha256 0123"}
    loaded, backbone = store.load()
    assert backbone == "some/backbone" and list(loaded) == list(groups)
    assert all(torch.equal(loaded[k], groups[k]) for k in groups)
    assert [p.name for p in tmp_path.iterdir()] == ["eval-base-features.safetensors"]  # no temporary file left
    from flowrl.run.rundir import run_files

    assert run_files(tmp_path) == [store.path]  # a run's file: log.overwrite=true deletes it with the others


# ------------------------------------------------------------------------------------------ config and preflight


def test_one_image_per_prompt_is_refused_at_config_time():
    with pytest.raises(
        ConfigError,
        match=r"eval.images_per_prompt=1 gives each prompt one; set "
        r"eval.images_per_prompt=2 or more",
    ):
        load_config(None, ["eval.diversity_features=facebook/dinov2-small"])
    assert (
        load_config(
            None, ["eval.diversity_features=facebook/dinov2-small", "eval.images_per_prompt=2"]
        ).eval.diversity_features
        == "facebook/dinov2-small"
    )
    with pytest.raises(ConfigError, match="backend=text makes text"):
        load_config(None, ["backend=text", "eval.diversity_features=x", "eval.images_per_prompt=2"])


def write_prompts(path: Path, groups: dict[str, int]) -> Path:
    rows = [{"prompt": f"{g} {i}", "family": g} for g, n in groups.items() for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_images_per_group_must_give_every_prompt_two_images(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", {"big": 3, "small": 1})
    base = [
        f"data.train_prompts={prompts}",
        "eval.group_by=family",
        "eval.num_prompts=0",
        f"eval.diversity_features={tmp_path / 'nowhere'}",
    ]
    cfg = load_config(None, [*base, "eval.images_per_group=3"])  # big's 3 prompts get 1 image each
    _, eval_set = load_prompt_sets(cfg)
    with pytest.raises(
        PreflightError,
        match=r"eval.images_per_group=3 gives fewer to the prompts of the 'family' "
        r"groups of these prompt counts: \{'big': 3\}; set "
        r"eval.images_per_group=6",
    ):
        check_eval_features(cfg, "sd3", eval_set)
    cfg = load_config(None, [*base, "eval.images_per_group=6"])  # 2 each: on to the backbone, which is missing
    with pytest.raises(PreflightError, match="nowhere"):
        check_eval_features(cfg, "sd3", load_prompt_sets(cfg)[1])


def test_a_video_family_is_refused(tmp_path):
    cfg = load_config(None, ["eval.diversity_features=facebook/dinov2-small", "eval.images_per_prompt=2"])
    with pytest.raises(PreflightError, match=r"wan makes videos .*set eval.diversity_features='' \(off\)"):
        check_eval_features(cfg, "wan", load_prompt_sets(cfg)[1])


def test_a_backbone_that_cannot_load_offline_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import flowrl.policies
    from flowrl.cli import main

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the backbone was checked")

    monkeypatch.setattr(flowrl.policies, "build_policy", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["eval.images_per_prompt=2", f"log.run_dir={tmp_path / 'run'}", "model.device=cpu"]
    rc = main(["train", *args, "eval.diversity_features=flowrl-tests/no-such-backbone"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert (
        "eval.diversity_features=flowrl-tests/no-such-backbone: the hub model is not in the Hugging Face cache "
        "and HF_HUB_OFFLINE=1 forbids downloading it"
    ) in err
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (other / "preprocessor_config.json").write_text("{}")
    rc = main(["train", *args, f"eval.diversity_features={other}"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "is a 'bert' checkpoint" in err and "dinov2, clip, clip_vision_model" in err, err


# ------------------------------------------------------------------------------------------ a tiny run


TINY = [
    *TINY_RUN,
    "eval.num_steps=2",
    "eval.num_prompts=2",
    "train.grpo.clip_low=0.2",
    "eval.grid=false",
    "eval.images_per_prompt=3",
]


@pytest.fixture(scope="module")
def dino(tmp_path_factory) -> Path:
    """A tiny random DINOv2 with its image processor, saved as a local directory."""
    from rewardtiny import save_tiny_dinov2

    directory = tmp_path_factory.mktemp("dino")
    save_tiny_dinov2(directory)
    return directory


def eval_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if SPREAD in r]


@pytest.mark.filterwarnings("ignore:resuming from .* with a changed config")
def test_a_run_logs_feature_diversity_against_its_first_eval_and_a_resume_reads_that_base(tmp_path, monkeypatch, dino):
    import flowrl.eval.evaluator as trainer_module
    from flowrl.train import Trainer

    builds = []
    build = trainer_module.build_feature_encoder

    def counted(cfg, device):
        builds.append(device)
        return build(cfg, device)

    monkeypatch.setattr(trainer_module, "build_feature_encoder", counted)
    run = tmp_path / "run"
    args = [*TINY, f"log.run_dir={run}", f"eval.diversity_features={dino}", "train.lr=3e-2"]
    Trainer(load_config(None, [*args, "train.epochs=2", "eval.every=1"])).fit()
    assert len(builds) == 1  # three evals, one backbone

    first, middle, final = eval_rows(run)
    assert first["epoch"] == 0 and final["epoch"] == 2
    # the first eval is the base model: compared with itself
    assert first[RATIO] == 1.0 and first[DISTANCE] == 0.0
    store = BaseFeatures(run)
    base, backbone = store.load()
    assert backbone == str(dino) and len(base) == 2 and all(f.shape[0] == 3 for f in base.values())
    assert first[SPREAD] == pytest.approx(sum(feature_spread(f) for f in base.values()) / 2, rel=1e-9)
    for row in (middle, final):
        assert all(math.isfinite(row[k]) for k in (SPREAD, RATIO, DISTANCE)), row
        assert row[DISTANCE] > 0 and row[RATIO] > 0
    written = store.path.read_bytes(), store.path.stat().st_mtime_ns

    def refuse(self, groups, backbone):
        raise AssertionError("a resumed run rewrote the base features")

    monkeypatch.setattr(BaseFeatures, "save", refuse)
    Trainer(load_config(None, [*args, "train.epochs=3", "eval.every=1", "checkpoint.resume=auto"])).fit()
    resumed = eval_rows(run)[-1]
    assert resumed["epoch"] == 3 and resumed[DISTANCE] > 0 and math.isfinite(resumed[RATIO])
    assert (store.path.read_bytes(), store.path.stat().st_mtime_ns) == written
    assert len(builds) == 2  # once per Trainer

    # another backbone (the same weights elsewhere): its features are not comparable with the base's, which stay
    import shutil

    other = Path(shutil.copytree(dino, tmp_path / "other_dino"))
    again = [a.replace(f"eval.diversity_features={dino}", f"eval.diversity_features={other}") for a in args]
    with pytest.warns(
        UserWarning, match="holds the base model's features by .*comparisons with the base model are left out"
    ):
        Trainer(load_config(None, [*again, "train.epochs=4", "checkpoint.resume=auto"])).fit()
    last = eval_rows(run)[-1]
    assert last["epoch"] == 4 and SPREAD in last and RATIO not in last and DISTANCE not in last
    assert (store.path.read_bytes(), store.path.stat().st_mtime_ns) == written

    # the same backbone, but a resume with other eval settings: its images do not pair with the base's, so the
    # comparisons are left out, with a warning naming what differs
    with pytest.warns(UserWarning, match=r"other settings \(eval.num_steps: 2 \(base\) vs 3\).*left out"):
        Trainer(load_config(None, [*args, "eval.num_steps=3", "train.epochs=5", "checkpoint.resume=auto"])).fit()
    last = eval_rows(run)[-1]
    assert last["epoch"] == 5 and SPREAD in last and RATIO not in last and DISTANCE not in last
    assert (store.path.read_bytes(), store.path.stat().st_mtime_ns) == written

    from flowrl.run.report import curves_figure, load_metrics

    labels = {line.get_label() for ax in curves_figure(load_metrics(run)).axes for line in ax.get_lines()}
    drawn = " ".join(labels)
    assert all(k[len("eval/") :] in drawn for k in (SPREAD, RATIO, DISTANCE)), labels


def test_flowrl_eval_of_the_base_model_is_its_own_base(tmp_path, dino):
    from flowrl.cli import main

    out = tmp_path / "ev"
    assert main(["eval", *TINY, f"eval.diversity_features={dino}", "--out", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["num_samples"] == 6 and 0 < result[SPREAD] <= 2
    assert (result[RATIO], result[DISTANCE]) == (1.0, 0.0) and "base" not in result


def test_flowrl_eval_of_a_checkpoint_compares_with_its_runs_base_or_with_base(tmp_path, dino, capsys):
    """`flowrl eval --checkpoint` reads the base model's features from the checkpoint's run directory (its eval
    before training): the same numbers as the run's final eval. An eval of the base model with --out writes them,
    and --base points at them; --base of a directory without them is refused, naming what to pass."""
    from flowrl.cli import main
    from flowrl.train import Trainer

    run = tmp_path / "run"
    args = [*TINY, f"eval.diversity_features={dino}", "train.lr=3e-2"]
    Trainer(load_config(None, [*args, f"log.run_dir={run}", "train.epochs=2"])).fit()
    first, final = eval_rows(run)[0], eval_rows(run)[-1]
    ckpt = str(run / "ckpt-000002")
    capsys.readouterr()
    assert main(["eval", *args, "--checkpoint", ckpt, "--out", str(tmp_path / "ck")]) == 0
    result = json.loads((tmp_path / "ck" / "eval.json").read_text())
    assert result["base"] == str(run)
    # each eval mean beside the base's (the run's eval before training), one line each on stderr
    means = [k for k in result if k.startswith("eval/") and k.endswith("_mean") and "diversity" not in k]
    err = capsys.readouterr().err
    assert means and err.count("flowrl eval: eval/") == len(means), err
    for key in means:
        b, a = first[key], result[key]
        assert f"flowrl eval: {key}: base {b:#.4g} -> checkpoint {a:#.4g} ({a - b:+#.3g})\n" in err
    for key in (SPREAD, RATIO, DISTANCE):
        assert result[key] == pytest.approx(final[key], rel=1e-6, abs=1e-12), key
    assert result[DISTANCE] > 0

    assert main(["eval", *args, "--out", str(tmp_path / "base")]) == 0  # the base model: its own base, kept
    base = json.loads((tmp_path / "base" / "eval.json").read_text())
    assert (base[RATIO], base[DISTANCE]) == (1.0, 0.0) and BaseFeatures(tmp_path / "base").exists()
    assert (
        main(["eval", *args, "--checkpoint", ckpt, "--base", str(tmp_path / "base"), "--out", str(tmp_path / "ck2")])
        == 0
    )
    again = json.loads((tmp_path / "ck2" / "eval.json").read_text())
    assert again["base"] == str(tmp_path / "base")
    key = means[0]  # the base's means from its eval.json (the base eval's, the same images as the run's first)
    assert f"flowrl eval: {key}: base {base[key]:#.4g} -> checkpoint {again[key]:#.4g}" in capsys.readouterr().err
    assert again[DISTANCE] == pytest.approx(result[DISTANCE], rel=1e-6, abs=1e-12)

    (tmp_path / "empty").mkdir()
    capsys.readouterr()
    assert main(["eval", *args, "--checkpoint", ckpt, "--base", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowrl eval: --base ") and "holds no base-model eval" in err and "\n" not in err

    # a base sampled with other eval settings is not compared with: an explicit --base is an error naming the
    # difference (before the model loads), the checkpoint's own run directory is passed over with a note
    assert main(["eval", *args, "eval.seed=5", "--checkpoint", ckpt, "--base", str(tmp_path / "base")]) == 1
    assert "other settings than this eval's (eval.seed: 1234 (base) vs 5)" in capsys.readouterr().err
    with pytest.warns(
        UserWarning,
        match=r"holds the base model's eval with other settings than this eval's "
        r"\(eval.seed: 1234 \(base\) vs 5\)",
    ):
        assert main(["eval", *args, "eval.seed=5", "--checkpoint", ckpt, "--out", str(tmp_path / "ck3")]) == 0
    unpaired = json.loads((tmp_path / "ck3" / "eval.json").read_text())
    assert "base" not in unpaired and SPREAD in unpaired and RATIO not in unpaired and DISTANCE not in unpaired
