"""The command line answers mistakes with one line naming what was wrong and what would be right (no traceback,
exit code != 0), checks before any model loads, and reads key=value overrides anywhere after the command."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_CFG = str(ROOT / "configs" / "tiny_cpu.yaml")
TINY = [
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=3",
    "sample.max_sequence_length=16",
    "eval.num_steps=2",
    "eval.num_prompts=2",
    "log.progress=false",
    "model.device=cpu",
]


def one_line_error(capsys, code, rc) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_report_on_a_missing_or_empty_run_directory(tmp_path, capsys):
    err = one_line_error(capsys, 1, main(["report", str(tmp_path / "nowhere")]))
    assert "nowhere is not a run directory: it does not exist" in err
    err = one_line_error(capsys, 1, main(["report", str(tmp_path)]))
    assert "no metrics.jsonl" in err


def test_eval_and_sample_with_a_missing_or_incomplete_checkpoint(tmp_path, capsys, no_model_load):
    err = one_line_error(capsys, 1, main(["eval", TINY_CFG, "--checkpoint", str(tmp_path / "ckpt-000009")]))
    assert "ckpt-000009' does not exist" in err
    half = tmp_path / "ckpt-000001"
    half.mkdir()
    (half / "state.json").write_text("{}")
    err = one_line_error(capsys, 1, main(["sample", TINY_CFG, "--checkpoint", str(half), "--prompt", "a cat"]))
    assert f"{half / 'trainable.safetensors'} is missing: the checkpoint is incomplete" in err


def test_a_model_directory_no_family_drives(tmp_path, capsys, no_model_load):
    model = tmp_path / "kandinsky"
    model.mkdir()
    (model / "model_index.json").write_text(
        json.dumps({"_class_name": "KandinskyPipeline", "unet": ["diffusers", "UNet2DModel"]})
    )
    rc = main(["train", TINY_CFG, *TINY, f"model.path={model}", f"log.run_dir={tmp_path / 'run'}"])
    err = one_line_error(capsys, 1, rc)
    assert "KandinskyPipeline" in err and "StableDiffusion3Pipeline" in err


def test_a_preset_whose_prompt_file_is_missing(tmp_path, capsys, no_model_load, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  train_prompts: data/animals.txt\n")
    err = one_line_error(capsys, 1, main(["train", str(cfg), *TINY]))
    assert "data.train_prompts" in err and "data/animals.txt" in err


def test_reward_mistakes_and_an_unwritable_run_dir_fail_before_the_model_loads(tmp_path, capsys, no_model_load):
    run = f"log.run_dir={tmp_path / 'run'}"
    err = one_line_error(capsys, 2, main(["train", TINY_CFG, *TINY, run, "rewards=[{name: pickscroe}]"]))
    assert "pickscroe" in err and "pickscore" in err
    err = one_line_error(
        capsys, 2, main(["train", TINY_CFG, *TINY, run, "rewards=[{name: jpeg_compressibility, kwargs: {qualty: 50}}]"])
    )
    assert "qualty" in err
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = one_line_error(capsys, 1, main(["train", TINY_CFG, *TINY, f"log.run_dir={blocker / 'run'}"]))
    assert err.endswith(
        f"its folder {str(blocker)!r} is a file, not a directory; choose a directory with log.run_dir=PATH"
    )
    err = one_line_error(capsys, 1, main(["train", TINY_CFG, *TINY, f"log.run_dir={blocker}"]))
    assert err == (
        f"flowrl train: log.run_dir={str(blocker)!r}: it is a file, not a directory; choose a directory with "
        "log.run_dir=PATH"
    )


def test_a_reward_whose_columns_a_prompt_file_lacks_fails_before_the_model_loads(tmp_path, capsys, no_model_load):
    """A reward declares the metadata columns it reads (rewards.register(columns=...), a plug-in's .columns); a
    prompt file without them is named, with its first such prompt, before the model loads."""
    free = tmp_path / "free.txt"
    free.write_text("a red circle\ntwo blue squares\n")
    shapes = [str(ROOT / "configs" / "shapes.yaml"), "eval.group_by=null", "eval.images_per_group=0"]
    err = one_line_error(capsys, 1, main(["eval", *shapes, f"data.eval_prompts={free}", "--out", str(tmp_path / "e")]))
    assert (
        f"rewards[0] (shapes_geneval) reads each prompt's 'objects' column, and data.eval_prompts has none at {free}:1"
        in err
    )
    assert "metadata columns are none (plain-text prompts" in err

    rows = tmp_path / "qa.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "solution": "4"}\n{"prompt": "3+3="}\n')
    text = [str(ROOT / "configs" / "text_arith.yaml"), f"log.run_dir={tmp_path / 'run'}"]
    err = one_line_error(capsys, 1, main(["train", *text, f"data.train_prompts={rows}"]))
    assert (
        f"(accuracy) reads each prompt's 'solution' or 'answer' column, and data.train_prompts has none at {rows}:3"
        in err
    )
    assert "columns are ['answer', 'solution']" in err

    (tmp_path / "judge.py").write_text(
        "def score(images, prompts, **columns):\n    return [0.0] * len(images)\n\nscore.columns = ('style',)\n"
    )
    plugin = f"rewards=[{{name: '{tmp_path / 'judge.py'}:score'}}]"
    err = one_line_error(capsys, 1, main(["train", TINY_CFG, *TINY, f"log.run_dir={tmp_path / 'r2'}", plugin]))
    assert "reads each prompt's 'style' column, and data.train_prompts has none at prompt 0" in err


def test_a_plugin_parameter_without_a_default_is_a_column_the_prompts_must_have(tmp_path, capsys, no_model_load):
    """A plug-in whose signature requires a parameter beyond the batch and its options (`style`) can only get it
    from a prompt's column: prompts without it are named before the model loads, not at the first eval's TypeError."""
    (tmp_path / "judge.py").write_text(
        "def score(images, prompts, style, scale, gain=1.0, **columns):\n    return [0.0] * len(images)\n"
    )
    plugin = f"rewards=[{{name: '{tmp_path / 'judge.py'}:score', kwargs: {{scale: 2}}}}]"
    err = one_line_error(capsys, 1, main(["train", TINY_CFG, *TINY, f"log.run_dir={tmp_path / 'r'}", plugin]))
    assert "judge.py:score) reads each prompt's 'style' column, and data.train_prompts has none at prompt 0" in err
    assert "'scale'" not in err  # an option, given in kwargs

    rows = tmp_path / "styled.jsonl"
    rows.write_text('{"prompt": "a red circle", "style": "flat"}\n')
    from flowrl.config import load_config
    from flowrl.data import load_config_prompts
    from flowrl.preflight import PreflightError, check_reward_columns

    cfg = load_config(TINY_CFG, [plugin, f"data.train_prompts={rows}"])
    prompts = load_config_prompts(cfg.data)
    check_reward_columns(cfg, prompts, prompts)  # the column is there: nothing to say

    (tmp_path / "styles.py").write_text(
        "def score(images, prompts, **columns):\n    return [0.0] * len(images)\n\n"
        "score.check_row = lambda row: '' if row.get('style') == 'flat' else f\"unknown style {row.get('style')!r}\"\n"
    )
    rows.write_text('{"prompt": "a red circle", "style": "flat"}\n{"prompt": "a cat", "style": "wavy"}\n')
    styles = f"rewards=[{{name: '{tmp_path / 'styles.py'}:score'}}]"
    cfg = load_config(TINY_CFG, [styles, f"data.train_prompts={rows}"])
    prompts = load_config_prompts(cfg.data)
    with pytest.raises(
        PreflightError, match=rf"cannot score data.train_prompts at {rows}:2: unknown style 'wavy'; fix"
    ):
        check_reward_columns(cfg, prompts, prompts)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"objects": "a square"}, "'objects' must be a non-empty list of objects such as"),
        ({"objects": []}, "'objects' must be a non-empty list"),
        ({"objects": [1]}, "objects[0] must be an object such as"),
        ({"objects": [{"shape": "hexagon", "color": None, "count": 1}]}, "objects[0]: 'shape' must be one of"),
        ({"objects": [{"shape": "circle", "color": "purple", "count": 1}]}, "'color' must be one of ['red'"),
        ({"objects": [{"shape": "circle", "color": None, "count": "two"}]}, "'count' must be a whole number >= 1"),
        ({"objects": [{"shape": "circle", "color": None, "count": 0}]}, "'count' must be a whole number >= 1, got 0"),
        ({"objects": [{"shape": "circle", "count": 1}] * 2}, "objects[1]: a second 'circle'"),
        ({"relation": "sideways"}, "'relation' must be null or one of ['left of'"),
        ({"relation": "above", "objects": [{"shape": "circle", "count": 1}]}, "it needs 2 objects, got 1"),
    ],
)
def test_shapes_metadata_the_detector_cannot_check_fails_before_the_model_loads(
    tmp_path, capsys, no_model_load, change, problem
):
    """shapes_geneval's `check_row`: an eval prompt whose metadata is outside the shapes world (a shape it has no
    detector for, a colour not in its palette, a count of 0, a relation it does not know) is named with its line
    before the model loads, not scored as never holding (silently) or failing after the eval sampled."""
    good = {"prompt": "a photo of a circle and a square", "objects": [{"shape": "circle", "color": "red", "count": 1},
            {"shape": "square", "color": None, "count": 1}], "relation": "left of"}  # fmt: skip
    rows = tmp_path / "eval.jsonl"
    rows.write_text(json.dumps(good) + "\n" + json.dumps({**good, **change}) + "\n")
    shapes = [str(ROOT / "configs" / "shapes.yaml"), "eval.group_by=null", "eval.images_per_group=0"]
    err = one_line_error(capsys, 1, main(["eval", *shapes, f"data.eval_prompts={rows}", "--out", str(tmp_path / "e")]))
    assert f"rewards[0] (shapes_geneval) cannot score data.eval_prompts at {rows}:2: " in err
    assert problem in err


def test_every_shipped_shapes_prompt_passes_the_shapes_rewards_row_check():
    from rewards import row_check

    geneval, soft = row_check("shapes_geneval"), row_check("shapes_soft")
    for name in ("train", "test", "val", "train_minus_val", "out_of_template", "motion/train", "motion/test"):
        for line in (ROOT / "samples" / "shapes" / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            assert geneval(row) == "" and soft(row) == "", (name, row)
    assert soft({"objects": [{"shape": "circle", "count": 1}], "relation": "sideways"}) == ""


def test_a_reward_declaring_bad_columns_is_refused_at_registration():
    from rewards.registry import register

    for bad in ("objects", (("",),), ((),), (3,)):
        with pytest.raises(ValueError, match="columns must be a tuple of column names"):
            register("test_bad_columns", kind="image", columns=bad)


def test_matched_pairs_without_a_counting_reward_fail_before_the_model_loads(tmp_path, capsys, no_model_load):
    """train.dpo.pairing=matched pairs by the free-attribute counts a reward declares (register(counts=...), a
    plug-in's .counts): rewards that declare none are named before the model loads; a reward that cannot say (a
    plug-in without .counts, a weighted sum) leaves it to the first update; a bad declaration is refused."""
    import rewards
    from rewards.registry import register

    assert rewards.declared_counts("shapes_geneval") == ("color",)
    assert rewards.declared_counts("jpeg_compressibility") == ()
    assert rewards.declared_counts("weighted") is None and rewards.declared_counts("remote") is None
    matched = [TINY_CFG, *TINY, "train.objective=dpo", "train.dpo.pairing=matched", f"log.run_dir={tmp_path / 'r'}"]
    err = one_line_error(capsys, 1, main(["train", *matched, "rewards=[{name: jpeg_compressibility}]"]))
    assert "pairing=matched pairs images by what they drew where the prompt left it free" in err
    assert "the run's rewards (jpeg_compressibility) count nothing" in err and "pairing=ranked" in err
    assert "counts=('color',)" in err

    (tmp_path / "judge.py").write_text(
        "def plain(images, prompts, **columns):\n    return [0.0] * len(images)\n\n"
        "def counted(images, prompts, **columns):\n    return [0.0] * len(images)\n\ncounted.counts = ('color',)\n\n"
        "def bad(images, prompts, **columns):\n    return [0.0] * len(images)\n\nbad.counts = 'color'\n"
    )
    assert rewards.declared_counts(f"{tmp_path / 'judge.py'}:plain") is None
    assert rewards.declared_counts(f"{tmp_path / 'judge.py'}:counted") == ("color",)
    err = one_line_error(capsys, 1, main(["train", *matched, f"rewards=[{{name: '{tmp_path / 'judge.py'}:bad'}}]"]))
    assert "counts must be a tuple of the free attributes it counts" in err and "'color'" in err
    for bad in ("color", ("free_color=red",), ("",), (3,)):
        with pytest.raises(ValueError, match="counts must be a tuple of the free attributes"):
            register("test_bad_counts", kind="image", counts=bad)


def test_a_device_this_machine_lacks_and_adam_betas_of_the_wrong_length(tmp_path, capsys, no_model_load):
    """model.device: not a device at all is refused when the config loads (the valid types named); a device this
    machine does not have fails before the model loads, for train, eval and sample alike. train.adam_betas takes
    two numbers."""
    import torch

    run = f"log.run_dir={tmp_path / 'run'}"
    # (the config's problems, one a line, all of them at once)
    assert main(["train", TINY_CFG, *TINY, run, "model.device=tpu", "train.adam_betas=[0.9]"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "model.device='tpu' is not a device" in err and "cpu, cuda, mps" in err
    assert "train.adam_betas takes two numbers" in err and "[0.9]" in err
    if not torch.cuda.is_available():
        for command in (["train", TINY_CFG, run], ["eval", TINY_CFG], ["sample", TINY_CFG, "--prompt", "a cat"]):
            err = one_line_error(capsys, 1, main([*command, *TINY, "model.device=cuda"]))
            assert "model.device=cuda but this machine has no CUDA device" in err and "model.device=cpu" in err


def test_a_reward_option_of_a_bad_value_is_one_line(tmp_path, capsys):
    """An option the reward's own constructor refuses (checked when it is built, after the model): one line with
    its message."""
    bad = "rewards=[{name: jpeg_compressibility, kwargs: {quality: abc}}]"
    err = one_line_error(capsys, 2, main(["train", TINY_CFG, *TINY, f"log.run_dir={tmp_path / 'run'}", bad]))
    assert "jpeg_compressibility" in err and "abc" in err


def test_a_model_directory_whose_files_are_broken(tmp_path, capsys):
    """A model_index.json that is not JSON names the file; a truncated weight file is one line naming the model
    directory and what to do (not diffusers' traceback)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(ROOT / "samples" / "shapes" / "model", model)
    sample = [
        "sample",
        str(ROOT / "configs" / "shapes.yaml"),
        f"model.path={model}",
        "log.progress=false",
        "--prompt",
        "x",
    ]
    weights = next((model / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main([*sample, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()  # (diffusers' loading bars above it)
    assert "Traceback" not in err
    err = err.splitlines()[-1]
    assert f"model.path={model}: its weights do not load" in err and "truncated" in err
    weights.unlink()  # deleted: the folder that lost it is named
    assert main([*sample, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"model.path={model}: transformer/ holds a config.json and no weights file" in err, err
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline",\n')
    err = one_line_error(capsys, 1, main([*sample, "--out", str(tmp_path / "o")]))
    assert f"{model / 'model_index.json'} is not valid JSON" in err


def test_a_run_that_takes_no_optimizer_step_says_so(tmp_path, capsys):
    """DPO on a reward that scores every image alike makes no pair: the run warns that the weights did not move."""
    (tmp_path / "flat.py").write_text("def flat(images, prompts, **columns):\n    return [0.0] * len(images)\n")
    flat = f"rewards=[{{name: '{tmp_path / 'flat.py'}:flat'}}]"
    args = [*TINY, "train.objective=dpo", "train.epochs=1", "eval.before=false", f"log.run_dir={tmp_path / 'r'}", flat]
    with pytest.warns(UserWarning, match="1 epoch took no optimizer step: in every group the rewards were alike"):
        assert main(["train", TINY_CFG, *args]) == 0
    # GRPO and NFT take their steps on zero advantages: the run says nothing was learned from the rewards
    common = [*TINY, "train.epochs=1", "eval.before=false"]
    for objective in ("grpo", "nft"):
        run = [*common, f"log.run_dir={tmp_path / objective}", flat, f"train.objective={objective}"]
        with pytest.warns(UserWarning, match=r"^in its one epoch every group's rewards were alike \(data/groups_"):
            assert main(["train", TINY_CFG, *run]) == 0
    graded = [*common, f"log.run_dir={tmp_path / 'graded'}"]  # (TINY's own reward tells the images apart)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["train", TINY_CFG, *graded]) == 0
    assert not [w for w in seen if "rewards were alike" in str(w.message)]


def test_overrides_after_options_and_a_stray_argument(tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(["eval", TINY_CFG, "--out", str(out), *TINY, "eval.num_prompts=1"]) == 0
    assert json.loads((out / "eval.json").read_text())["num_samples"] == 1
    with pytest.raises(SystemExit):
        main(["eval", TINY_CFG, "--out", str(out), "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err
    # a misspelt option: the command's usage (not the list of commands) and the option meant
    with pytest.raises(SystemExit) as code:
        main(["eval", TINY_CFG, "--chekpoint", str(out)])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.startswith("usage: flowrl eval ")
    assert err.rstrip().endswith(
        f"flowrl eval: error: unrecognized arguments: --chekpoint {out} (did you mean --checkpoint?)"
    )
    for command in (["sample", "--prompt", "a cat"], ["sample"]):  # overrides are optional: not named as required
        with pytest.raises(SystemExit):
            main(command)
        err = capsys.readouterr().err
        assert err.rstrip().endswith("required: config")


def test_sample_takes_a_prompt_file_after_its_prompts_and_checks_it_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    from flowrl.eval import samples

    seen = {}

    def record(policy, prompts, seeds, out, **kwargs):
        seen["prompts"] = list(prompts)
        return len(prompts) * len(seeds)

    monkeypatch.setattr(samples, "sample_to_dir", record)
    rows = tmp_path / "p.csv"
    rows.write_text("Prompts,Category\na red circle,colors\ntwo blue squares,counting\n")
    sample = ["sample", TINY_CFG, *TINY, "--out", str(tmp_path / "out")]
    assert main([*sample, "--prompt", "a cat", "--prompts", str(rows), "data.prompt_column=Prompts"]) == 0
    assert seen["prompts"] == ["a cat", "a red circle", "two blue squares"]
    import flowrl.run.loading

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the mistake was reported")

    monkeypatch.setattr(flowrl.run.loading, "policy_from_checkpoint", refuse)
    with pytest.raises(SystemExit) as info:  # the column is Prompts, not prompt
        main([*sample, "--prompts", str(rows)])
    err = str(info.value)
    assert err.startswith(f"flowrl sample: --prompts: {rows}:2: no prompt column 'prompt' (data.prompt_column)")
    assert "(Prompts, Category)" in err and "\n" not in err
    err = one_line_error(capsys, 2, main(sample))  # a usage error: exit code 2
    assert err.startswith("flowrl sample: no prompts: give --prompt TEXT (repeatable) or --prompts")


def test_sample_names_files_by_prompt_and_seed_and_each_image_is_its_seeds(tmp_path):
    import numpy as np
    from PIL import Image

    both = tmp_path / "both"
    assert (
        main(
            [
                "sample",
                TINY_CFG,
                *TINY,
                "--prompt",
                "a red circle",
                "--prompt",
                "a blue square",
                "--num",
                "2",
                "--seed",
                "5",
                "--out",
                str(both),
            ]
        )
        == 0
    )
    names = sorted(p.name for p in both.glob("*.png"))
    assert names == ["000_seed5.png", "000_seed6.png", "001_seed5.png", "001_seed6.png"]
    listed = [json.loads(line) for line in (both / "samples.jsonl").read_text().splitlines()]
    assert {(r["file"], r["prompt"], r["seed"]) for r in listed} >= {("001_seed6.png", "a blue square", 6)}
    alone = tmp_path / "alone"
    assert main(["sample", TINY_CFG, *TINY, "--prompt", "a blue square", "--seed", "6", "--out", str(alone)]) == 0
    a = np.asarray(Image.open(both / "001_seed6.png"), dtype=np.int16)
    b = np.asarray(Image.open(alone / "000_seed6.png"), dtype=np.int16)
    assert np.abs(a - b).max() <= 1  # the same image whatever is sampled beside it


def test_sample_checks_its_images_before_the_model_loads(tmp_path, capsys, no_model_load):
    from PIL import Image

    kontext = [*TINY, "model.path=tiny-flux_kontext"]
    err = one_line_error(capsys, 1, main(["sample", TINY_CFG, *kontext, "--prompt", "make it blue"]))
    assert "--image: flux_kontext takes exactly 1 image per prompt, got 0" in err
    err = one_line_error(
        capsys,
        1,
        main(["sample", TINY_CFG, *kontext, "--prompt", "make it blue", "--image", str(tmp_path / "nope.png")]),
    )
    assert "nope.png' is not an image" in err
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    err = one_line_error(
        capsys, 1, main(["sample", TINY_CFG, *TINY, "--prompt", "a cat", "--image", str(tmp_path / "a.png")])
    )
    assert "sd3 is a text-to-image family and takes no conditioning image, got 1" in err


def test_sample_prompts_of_an_edit_set_take_each_rows_own_source_image(tmp_path, capsys, monkeypatch):
    """`flowrl sample --prompts FILE` of an editing model: each row samples with the images of its own `image`
    column (data.image_column), as training and the eval read them, and samples.jsonl names them. The file's
    images beside --image, or a --prompt without an image beside them, are one line each."""
    from PIL import Image

    from flowrl.policies.image import ImagePolicy

    kontext = [*TINY, "model.path=tiny-flux_kontext"]
    for k, color in enumerate(("red", "blue")):
        Image.new("RGB", (32, 32), color).save(tmp_path / f"src{k}.png")
    rows = [{"prompt": f"make it green {k}", "image": f"src{k}.png"} for k in range(2)]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls, real = [], ImagePolicy.sample

    def recorded(self, prompts, seeds, **kwargs):
        calls.append((list(prompts), list(kwargs["image_paths"])))
        return real(self, prompts, seeds, **kwargs)

    monkeypatch.setattr(ImagePolicy, "sample", recorded)
    out = tmp_path / "out"
    assert main(["sample", TINY_CFG, *kontext, "--prompts", str(tmp_path / "edits.jsonl"), "--out", str(out)]) == 0
    sources = [str(tmp_path / "src0.png"), str(tmp_path / "src1.png")]
    assert calls == [(["make it green 0"], sources[:1]), (["make it green 1"], sources[1:])]
    listed = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["file"], r["images"]) for r in listed] == [
        ("000_seed0.png", sources[:1]),
        ("001_seed0.png", sources[1:]),
    ]
    capsys.readouterr()
    image = ["--image", sources[1]]
    both = ["--prompts", str(tmp_path / "edits.jsonl"), *image, "--out", str(tmp_path / "x")]
    err = one_line_error(capsys, 1, main(["sample", TINY_CFG, *kontext, *both]))
    assert "gives each row's images (its 'image' column, data.image_column) and --image every prompt's" in err
    mixed = ["--prompts", str(tmp_path / "edits.jsonl"), "--prompt", "a cat", "--out", str(tmp_path / "x")]
    err = one_line_error(capsys, 1, main(["sample", TINY_CFG, *kontext, *mixed]))
    assert "--prompt #1: flux_kontext takes exactly 1 image per prompt, got 0" in err


def test_sample_checks_its_counts_and_its_folder_before_the_model_loads(tmp_path, capsys, no_model_load):
    """--num, --steps and an --out that cannot be written (here a file's path as a folder; `flowrl eval --out` too):
    one line each, before the model loads, so that nothing sampled is lost to them."""
    sample = ["sample", TINY_CFG, *TINY, "--prompt", "a cat"]
    err = one_line_error(capsys, 2, main([*sample, "--num", "0"]))  # usage errors: exit code 2
    assert err == "flowrl sample: --num must be >= 1 (images or completions per prompt), got 0"
    err = one_line_error(capsys, 2, main([*sample, "--steps", "-2"]))
    assert err == "flowrl sample: --steps must be >= 0 (0: eval.num_steps), got -2"
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "images"
    err = one_line_error(capsys, 1, main([*sample, "--out", str(out)]))
    file = f"its folder {str(tmp_path / 'a-file')!r} is a file, not a directory"
    assert err == f"flowrl sample: --out='{out}': {file}; choose a directory with --out=PATH"
    err = one_line_error(capsys, 1, main(["eval", TINY_CFG, *TINY, "--out", str(out)]))  # eval's --out alike
    assert err == f"flowrl eval: --out='{out}': {file}; choose a directory with --out=PATH"


def test_calibrate_prints_the_ratios_and_the_entry_that_uses_them(tmp_path, capsys):
    """`flowrl calibrate`: mag_cache's ratios for the config's rollout, one per step, and a YAML entry that loads as
    a valid rollout.acceleration; a model the cache cannot take and a bad --prompts are one line."""
    import yaml

    from flowrl.config import load_config

    flux = [*TINY, "model.path=tiny-flux", "train.objective=dpo"]
    rc = main(["calibrate", TINY_CFG, *flux, "--prompts", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    entry = yaml.safe_load(out[out.index("rollout:") :])
    ratios = entry["rollout"]["acceleration"][0]["mag_ratios"]
    assert len(ratios) == 3 and ratios[0] == 1.0 and all(r > 0 for r in ratios)
    cfg = load_config(TINY_CFG, [*flux, f"rollout.acceleration={json.dumps(entry['rollout']['acceleration'])}"])
    assert cfg.rollout.acceleration[0]["mag_ratios"] == ratios
    err = one_line_error(capsys, 2, main(["calibrate", TINY_CFG, *TINY, "model.path=tiny-sd3"]))
    assert "mag_cache is not available for family sd3" in err
    err = one_line_error(capsys, 2, main(["calibrate", TINY_CFG, *flux, "--prompts", "0"]))
    assert "--prompts must be >= 1" in err


def test_sample_calls_hold_per_call_images_and_each_call_is_written_at_once(tmp_path):
    """flowrl sample's calls: whole prompts with all their seeds when they fit in `per_call`, else one prompt's seeds
    in parts; what a call returned is on disk (and listed) even when a later call fails."""
    from PIL import Image

    from flowrl.eval.samples import sample_to_dir
    from flowrl.policies.image import ImagePolicy

    class Fake:
        def __init__(self, fail_at=None):
            self.calls, self.fail_at = [], fail_at

        def sample(self, prompts, seeds, **kwargs):
            self.calls.append((list(prompts), list(seeds)))
            if len(self.calls) == self.fail_at:
                raise RuntimeError("out of memory")
            return [Image.new("RGB", (4, 4), (len(p), s, 0)) for p in prompts for s in seeds]  # prompt-major

        save_sample = ImagePolicy.save_sample

    fake = Fake()
    fake.cfg = None  # save_sample reads the config only for videos
    assert (
        sample_to_dir(fake, ["a", "bb", "ccc"], [1, 2], tmp_path / "x", num_steps=1, guidance_scale=1, per_call=4) == 6
    )
    assert fake.calls == [(["a", "bb"], [1, 2]), (["ccc"], [1, 2])]
    assert Image.open(tmp_path / "x" / "001_seed2.png").getpixel((0, 0)) == (2, 2, 0)  # prompt "bb", seed 2
    listed = [json.loads(line) for line in (tmp_path / "x" / "samples.jsonl").read_text().splitlines()]
    assert [(r["file"], r["prompt"], r["seed"]) for r in listed][:3] == [
        ("000_seed1.png", "a", 1),
        ("000_seed2.png", "a", 2),
        ("001_seed1.png", "bb", 1),
    ]
    fake = Fake(fail_at=3)
    fake.cfg = None
    with pytest.raises(RuntimeError, match="out of memory"):
        sample_to_dir(fake, ["a", "bb"], [1, 2, 3], tmp_path / "y", num_steps=1, guidance_scale=1, per_call=2)
    assert fake.calls == [(["a"], [1, 2]), (["a"], [3]), (["bb"], [1, 2])]  # seeds in parts, one prompt a call
    kept = sorted(p.name for p in (tmp_path / "y").iterdir())
    assert kept == ["000_seed1.png", "000_seed2.png", "000_seed3.png", "samples.jsonl"]  # no temporary file left
    assert len((tmp_path / "y" / "samples.jsonl").read_text().splitlines()) == 3


def test_checkpoint_may_be_a_run_directory_its_newest_is_taken(tmp_path, capsys):
    """--checkpoint RUN_DIR (what users give as often as RUN_DIR/ckpt-XXXXXX): the run's newest complete checkpoint,
    named on stderr; the same images as naming that checkpoint. A run directory without one, or a directory that is
    neither, is one line."""
    import numpy as np
    from PIL import Image

    run = tmp_path / "run"
    args = [*TINY, "train.epochs=2", "checkpoint.every=1", "checkpoint.keep=0", "eval.before=false"]
    assert main(["train", TINY_CFG, *args, f"log.run_dir={run}"]) == 0
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000001", "ckpt-000002"]
    capsys.readouterr()
    sample = ["sample", TINY_CFG, *TINY, "--prompt", "a red circle"]
    assert main([*sample, "--checkpoint", str(run), "--out", str(tmp_path / "by_run")]) == 0
    assert f"{run} is a run directory: its newest checkpoint, {run / 'ckpt-000002'}" in capsys.readouterr().err
    assert main([*sample, "--checkpoint", str(run / "ckpt-000002"), "--out", str(tmp_path / "by_ckpt")]) == 0
    assert "is a run directory" not in capsys.readouterr().err
    a, b = (np.asarray(Image.open(tmp_path / d / "000_seed0.png")) for d in ("by_run", "by_ckpt"))
    assert np.array_equal(a, b)
    assert main([*sample, "--checkpoint", str(run / "ckpt-000001"), "--out", str(tmp_path / "first")]) == 0
    assert not np.array_equal(a, np.asarray(Image.open(tmp_path / "first" / "000_seed0.png")))  # another epoch's

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text("")
    # a second sample into the same --out keeps the first one's images listed; a file of the same name is replaced
    assert (
        main(
            [*sample[:-1], "a blue square", "--seed", "1", "--checkpoint", str(run), "--out", str(tmp_path / "by_run")]
        )
        == 0
    )
    listed = [json.loads(line) for line in (tmp_path / "by_run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["file"], r["prompt"], r["seed"]) for r in listed] == [
        ("000_seed0.png", "a red circle", 0),
        ("000_seed1.png", "a blue square", 1),
    ]
    # eval.json says which weights auto picked (this run kept no EMA: its trained ones)
    for weights, recorded in (("auto", "trained (auto)"), ("trained", "trained")):
        out = tmp_path / f"ev_{weights}"
        rc = main(["eval", TINY_CFG, *TINY, "--checkpoint", str(run), "--weights", weights, "--out", str(out)])
        assert rc == 0 and json.loads((out / "eval.json").read_text())["weights"] == recorded
    capsys.readouterr()
    err = one_line_error(capsys, 1, main(["eval", TINY_CFG, *TINY, "--checkpoint", str(bare)]))
    assert "is a run directory without a complete checkpoint yet" in err
    err = one_line_error(capsys, 1, main(["eval", TINY_CFG, *TINY, "--checkpoint", str(tmp_path / "first")]))
    assert "is not a checkpoint directory (no state.json or trainable.safetensors) nor a run directory" in err
    # a run directory whose checkpoints are all damaged says so, naming the newest one's problem
    for ckpt in run.glob("ckpt-*"):
        (ckpt / "state.json").unlink()
    err = one_line_error(capsys, 1, main(["eval", TINY_CFG, *TINY, "--checkpoint", str(run)]))
    assert err == (
        f"flowrl eval: --checkpoint {run}: the run directory {str(run)!r} holds 2 checkpoints, all damaged (the "
        f"newest, ckpt-000002: {run / 'ckpt-000002' / 'state.json'} is missing: the checkpoint is incomplete); "
        "resume or evaluate one that is whole, or start over"
    )


COUNTERS = {"epochs_done": 1, "optimizer_steps": 1}


def test_eval_of_a_checkpoint_of_another_model_is_that_error_alone(tmp_path, capsys, tiny_lm, no_model_load):
    """`flowrl eval` of a text config with an image run's checkpoint: the checkpoint's model is checked first, so
    the one line is that error (not a line about the run's eval before training, sampled with other settings)."""
    from conftest import tiny_gpt2_overrides

    from flowrl.config import load_config, to_dict
    from flowrl.eval.diversity import BaseMetrics
    from flowrl.run.checkpoint import write_checkpoint

    run = tmp_path / "run"
    image = to_dict(load_config(TINY_CFG, TINY))
    ckpt = write_checkpoint(run, 1, trainable={"w": torch.ones(2)}, state={"counters": COUNTERS, "config": image})
    BaseMetrics(run).save({"eval/jpeg_compressibility_mean": -1.5}, {"eval.num_steps": 2, "sample.height": 32})
    assert BaseMetrics(run).path.exists()
    text = [*tiny_gpt2_overrides(tiny_lm), "log.progress=false", "eval.num_prompts=2"]
    with warnings.catch_warnings(record=True) as caught:  # (a warning would be a line `flowrl: ...` before it)
        warnings.simplefilter("always")
        # a config that does not fit the checkpoint is a config error: exit code 2
        err = one_line_error(capsys, 2, main(["eval", *text, "--checkpoint", str(ckpt)]))
    assert not [w for w in caught if "base model's eval" in str(w.message)], [str(w.message) for w in caught]
    assert err.startswith(
        f"flowrl eval: checkpoint {ckpt} was trained with another model or adapter than this config's (backend: "
        "'image' -> 'text'"
    )


def test_sample_a_text_config_draws_seeded_or_greedy_completions(tmp_path, capsys):
    """`flowrl sample` of a text config (the shipped arithmetic model): --num completions drawn as the rollouts
    draw them, the same for the same prompts and seeds; --greedy is the argmax decoding (computed here by hand
    from the model's logits); samples.jsonl keeps an earlier call's other completions; the image-only flags and
    --greedy with --num > 1 are one line each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = str(ROOT / "configs" / "text_arith.yaml")
    out, again = tmp_path / "out", tmp_path / "again"
    prompts = ["--prompt", "12+34=", "--prompt", "5+7="]
    assert main(["sample", cfg, *prompts, "--num", "3", "--seed", "4", "--out", str(out), "log.progress=false"]) == 0
    assert "wrote 6 completions" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["seed"]) for r in rows] == [(p, s) for p in ("12+34=", "5+7=") for s in (4, 5, 6)]
    assert main(["sample", cfg, *prompts, "--num", "3", "--seed", "4", "--out", str(again), "log.progress=false"]) == 0
    assert (again / "samples.jsonl").read_text() == (out / "samples.jsonl").read_text()
    assert all(set(r["completion"]) <= set("0123456789+=") and len(r["completion"]) <= 4 for r in rows)
    assert len({r["completion"] for r in rows}) > 1  # sampled at temperature 1, not all alike

    assert main(["sample", cfg, "--prompt", "12+34=", "--greedy", "--out", str(out), "log.progress=false"]) == 0
    listed = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert listed[:6] == rows and [(r["prompt"], r["seed"]) for r in listed[6:]] == [("12+34=", "greedy")]
    tok = AutoTokenizer.from_pretrained(ROOT / "samples" / "arith")
    model = AutoModelForCausalLM.from_pretrained(ROOT / "samples" / "arith").eval()
    ids = tok("12+34=", return_tensors="pt")["input_ids"]
    want = []
    with torch.no_grad():
        for _ in range(4):  # text.max_new_tokens
            nxt = int(model(ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert listed[6]["completion"] == tok.decode(want)

    capsys.readouterr()
    for extra, words in (
        (["--greedy", "--num", "2"], "--greedy gives one completion per prompt"),
        (["--steps", "4"], "--image and --steps are an image model's"),
    ):
        err = one_line_error(capsys, 2, main(["sample", cfg, "--prompt", "1+1=", *extra, "--out", str(tmp_path / "x")]))
        assert words in err
    err = one_line_error(capsys, 2, main(["sample", TINY_CFG, *TINY, "--prompt", "a cat", "--greedy"]))
    assert "--greedy is a text model's decoding" in err
    err = one_line_error(capsys, 2, main(["sample", cfg, "--prompt", "1+1=", "--prompt", " ", "--out", "x"]))
    assert "flowrl sample: --prompt #2 is empty; a language model continues a prompt" in err


def test_eval_of_a_vllm_config_runs_without_its_server(tmp_path, capsys):
    """flowrl eval's completions are greedy on the trainer's own model: a text.engine=vllm config evaluates with
    no server at text.vllm_url (flowrl train asks it before the model loads)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    cfg = str(ROOT / "configs" / "text_arith.yaml")
    run = ["text.engine=vllm", f"text.vllm_url=http://127.0.0.1:{port}", "eval.num_prompts=2", "log.progress=false"]
    assert main(["eval", cfg, *run]) == 0
    assert "eval/" in capsys.readouterr().out


def test_a_lora_given_as_checkpoint_is_sent_to_lora_init_path(tmp_path, capsys, no_model_load):
    """--checkpoint naming a LoRA (diffusers' save_lora_weights directory or file, peft's save_pretrained directory)
    says to give it as lora.init_path; a checkpoint's own lora/ names the checkpoint; a file is not said missing."""
    import torch
    from safetensors.torch import save_file

    diffusers_dir, peft_dir, ckpt = tmp_path / "style", tmp_path / "peft", tmp_path / "ckpt-000003"
    for d in (diffusers_dir, peft_dir, ckpt / "lora"):
        d.mkdir(parents=True)
    tensors = {"transformer.blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8)}
    save_file(tensors, str(diffusers_dir / "pytorch_lora_weights.safetensors"))
    save_file(tensors, str(ckpt / "lora" / "pytorch_lora_weights.safetensors"))
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(2, 8)}, str(peft_dir / "adapter_model.safetensors"))
    (ckpt / "state.json").write_text("{}")
    sample = ["sample", TINY_CFG, *TINY, "--prompt", "a cat", "--checkpoint"]
    for given in (diffusers_dir, diffusers_dir / "pytorch_lora_weights.safetensors", peft_dir):
        err = one_line_error(capsys, 1, main([*sample, str(given)]))
        assert "holds a LoRA" in err and f"give it as lora.init_path={given} and no --checkpoint" in err, err
    for given in (ckpt / "lora", ckpt / "lora" / "pytorch_lora_weights.safetensors"):
        err = one_line_error(capsys, 1, main(["eval", TINY_CFG, *TINY, "--checkpoint", str(given)]))
        assert f"is the LoRA that checkpoint '{ckpt}' exports" in err and f"--checkpoint {ckpt}" in err, err
    err = one_line_error(capsys, 1, main([*sample, str(ckpt / "state.json")]))
    assert "is a file, not a directory" in err


def test_sample_checks_lora_init_path_before_the_model_loads(tmp_path, capsys, no_model_load):
    """flowrl sample with lora.init_path: a LoRA of another component or alpha is one line before the model loads."""
    import torch
    from safetensors.torch import save_file

    unet = tmp_path / "unet_lora.safetensors"
    save_file({"unet.down_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(8, 8)}, str(unet))
    rc = main(["sample", TINY_CFG, *TINY, "--prompt", "a cat", f"lora.init_path={unet}"])
    err = one_line_error(capsys, 1, rc)
    assert "a LoRA of the pipeline's unet, and this model's trained network is its transformer" in err


def test_flowrl_warnings_are_one_line_and_shown_by_rank_0_only(monkeypatch):
    import warnings

    from flowrl import cli
    from flowrl.config import ConfigWarning

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    cli._one_line_warnings()
    ours, theirs = ("a key moved", ConfigWarning, cli.__file__, 1), ("not ours", DeprecationWarning, "/x/lib.py", 3)
    shown = {}
    for rank in ("0", "1", None):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        shown[rank] = (warnings.formatwarning(*ours), warnings.formatwarning(*theirs))
    assert shown["0"][0] == shown[None][0] == "flowrl: a key moved\n"
    assert shown["1"][0] == ""  # rank 0 says it for the launch
    assert all(
        "DeprecationWarning: not ours" in theirs for _, theirs in shown.values()
    )  # another library's: every rank


def test_a_reward_whose_hub_weights_are_not_cached_offline_fails_before_the_model_loads(
    tmp_path, capsys, no_model_load, monkeypatch
):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    run = f"log.run_dir={tmp_path / 'run'}"
    err = one_line_error(capsys, 1, main(["train", TINY_CFG, *TINY, run, "rewards=[{name: aesthetic}]"]))
    assert err.startswith("flowrl train: rewards[0] (aesthetic): model='openai/clip-vit-large-patch14' is neither")
    assert err.endswith("give a local copy: rewards.0.kwargs.model=/path/to/dir")


def test_ctrl_c_before_any_stop_handler_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while a command starts (torch importing, before `flowrl train` installs its stop handler) or in a
    command without one: one line, exit 128 + SIGINT, no traceback."""
    import flowrl.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_train", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == "flowrl train: interrupted by SIGINT\n"


def test_version_and_every_argument_of_every_command_has_help(capsys):
    """`flowrl --version` names the installed version; each subcommand's --help explains each of its arguments."""
    from importlib.metadata import version

    from flowrl.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"flowrl {version('flowrl')}"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = [
        f"{name} {action.dest}"
        for name, command in sub.choices.items()
        for action in command._actions
        if action.dest != "help" and not action.help
    ]
    assert not missing, missing


def test_the_offline_kernels_notice_is_dropped_and_nothing_else(caplog):
    """transformers' `kernels` logs a publisher-check notice on every offline command; the command line drops that
    line alone."""
    import logging

    from flowrl.cli import _quiet_offline_kernels

    _quiet_offline_kernels()
    log = logging.getLogger("kernels._internals.hf_hub")
    with caplog.at_level(logging.WARNING):
        log.warning("Skipping publisher trust check for 'kernels-community/x' because Hugging Face Hub is offline.")
        log.warning("a kernel failed to load")
    assert [r.getMessage() for r in caplog.records] == ["a kernel failed to load"]


def test_train_prints_its_result_as_strict_json(tmp_path, capsys, monkeypatch):
    """The result JSON on stdout: a metric that is not finite (no sample could be scored) is null, not NaN, which
    strict readers refuse."""
    import flowrl.train

    def trained(cfg):
        return {"reward/total_mean": float("nan"), "eval/r_mean": 0.5, "policy/loss": 1.0}

    monkeypatch.setattr(flowrl.train, "train", trained)
    assert main(["train", TINY_CFG, f"log.run_dir={tmp_path}"]) == 0

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse) == {"eval/r_mean": 0.5, "reward/total_mean": None}


def test_demo_toy_takes_no_config_or_overrides(capsys):
    for extra in (["train.seed=3"], [TINY_CFG]):
        err = one_line_error(capsys, 2, main(["demo", "--toy", *extra]))
        assert err == f"flowrl demo: --toy trains the tabular toy, which takes no config or overrides (got {extra[0]})"
    assert main(["demo", "--toy"]) == 0
    assert "mean reward, first 5 steps" in capsys.readouterr().out


def test_plan_refuses_a_reward_that_does_not_resolve(capsys):
    """flowrl plan checks the rewards as a run would (cheaply): an unknown name is one line, not a note beside a
    plan of a config that cannot run. It is a config error (exit code 2), in every command and in serve-reward."""
    err = one_line_error(capsys, 2, main(["plan", TINY_CFG, "rewards.0.name=pickscor"]))
    assert "flowrl plan: rewards[0] (pickscor): unknown reward 'pickscor'. Did you mean 'pickscore'" in err
    err = one_line_error(capsys, 2, main(["train", TINY_CFG, "rewards.0.name=pickscor"]))
    assert err.startswith("flowrl train: rewards[0] (pickscor): unknown reward 'pickscor'.")
    err = one_line_error(capsys, 2, main(["serve-reward", "pickscor"]))
    assert err.startswith("flowrl serve-reward: unknown reward 'pickscor'.") and "or a plug-in" in err
    err = one_line_error(capsys, 2, main(["train", TINY_CFG, "rewards.0.name=nowhere.py:score"]))
    assert "file 'nowhere.py' not found" in err


def test_a_resume_whose_config_changed_what_was_trained_exits_as_a_config_error(tmp_path, capsys):
    """`cannot resume ...: the config changed what the checkpoint was trained as` is a config mistake (exit code 2),
    as the checks before the model loads are; a damaged checkpoint stays exit code 1."""
    run = [TINY_CFG, *TINY, f"log.run_dir={tmp_path}", "train.epochs=1", "eval.before=false"]
    assert main(["train", *run]) == 0
    capsys.readouterr()
    err = one_line_error(
        capsys, 2, main(["train", *run, "checkpoint.resume=auto", "train.epochs=2", "train.objective=nft"])
    )
    assert "cannot resume from" in err and "the config changed what the checkpoint was trained as" in err
