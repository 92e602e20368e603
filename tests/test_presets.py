"""Every preset loads, and one whose model is a hub id fails at once offline, before anything loads, naming the id
and HF_HUB_OFFLINE (not after ~60 s of retries, not with a traceback)."""

from pathlib import Path

import pytest
import yaml

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


def model_path(preset: Path) -> str:
    return (yaml.safe_load(preset.read_text()).get("model") or {}).get("path", "")


HUB_PRESETS = [p for p in PRESETS if "/" in model_path(p) and not (ROOT / model_path(p)).exists()]


def test_the_hub_presets_are_found():
    names = {p.stem for p in HUB_PRESETS}
    assert {"sd35m_pickscore", "flux_dev_pickscore", "sd15_aesthetic", "text_qwen_gsm8k"} <= names


@pytest.mark.parametrize("preset", HUB_PRESETS, ids=lambda p: p.stem)
def test_a_hub_preset_fails_at_once_offline_naming_the_model(preset, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    import flowrl.policies

    monkeypatch.chdir(ROOT)  # the presets' prompt files are relative to the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def refuse(*a, **k):
        raise AssertionError("the model was loaded: the offline check must come first")

    monkeypatch.setattr(flowrl.policies, "build_policy", refuse)
    model = model_path(preset)
    local_data = []  # the text presets' dataset would fail first (at once too): give them local prompts
    if "backend: text" in preset.read_text():
        local_data = ["data.train_prompts=samples/arith/train.jsonl", "data.eval_prompts=samples/arith/test.jsonl",
                      "data.prompt_column=prompt", "data.prompt_template='{prompt}'"]
    rc = main(["train", str(preset), f"log.run_dir={tmp_path / 'run'}", *local_data])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert model in err and "HF_HUB_OFFLINE" in err, err


def test_the_accelerate_configs_are_valid_accelerate_configs():
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
    assert {f.stem for f in files} >= {"ddp_8gpu", "multinode_2x8gpu", "cpu_2proc", "fsdp_8gpu", "deepspeed_zero2",
                                       "deepspeed_zero3"}
    for f in files:
        cfg = load_config_from_file(str(f))
        expected = "DEEPSPEED" if f.stem.startswith("deepspeed") else "MULTI_GPU"
        assert cfg.distributed_type.value == expected and cfg.num_processes >= 2, f
        assert f"--config_file configs/accelerate/{f.name}" in f.read_text(), f  # its header shows the launch
        assert cfg.num_processes % cfg.num_machines == 0, f
