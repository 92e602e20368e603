"""benchmarks/gpu_check.py --tiny: the GPU check pack runs end to end on the CPU with tiny models, so that it cannot
rot between GPU runs: every case trains two epochs through flowrl's Trainer, is measured and planned, and the report
files are written."""

import json
import math
from pathlib import Path

import torch
from repo_files import load_module


def load_pack():
    return load_module("benchmarks/gpu_check.py", "gpu_check_pack", register=True)


def test_gpu_check_tiny_runs_every_case(tmp_path):
    pack = load_pack()
    threads = torch.get_num_threads()
    try:
        rows = pack.main(["--tiny", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    cases = [c for c in pack.CASES if not c.gpu_only]
    assert [r["case"] for r in rows] == [c.name for c in cases]
    assert not [r for r in rows if "error" in r], rows
    for row, case in zip(rows, cases):
        for key in ("rollout_gib", "update_gib", "planned_rollout_gib", "planned_update_gib", "rollout_per_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (case.name, key, row[key])
        # the planner and the measurement describe the same run: within a factor of 4 even for tiny models
        assert 0.25 < row["update_ratio"] < 4 and 0.25 < row["rollout_ratio"] < 4, row
        assert row["images"] == case.prompts * case.group
        if case.objective == "grpo":  # float32 on the CPU: the first minibatch is on policy
            assert abs(row["ratio_first"] - 1) < 1e-5, row
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["environment"]["device"].startswith("CPU")
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {c.name} |" in table for c in cases)


def test_gpu_check_builds_real_widths_from_the_shipped_configs():
    """The real-size cases read the architecture configs shipped for the planner: the denoisers the GPU run builds
    are SD3.5-Medium's and FLUX.1-dev's."""
    pack = load_pack()
    shipped = Path(__file__).resolve().parents[1] / "flowrl" / "plan_configs"
    sd3 = json.loads((shipped / pack.MODELS["sd35m"].plan_config).read_text())["transformer/config.json"]
    flux = json.loads((shipped / pack.MODELS["flux1-dev"].plan_config).read_text())["transformer/config.json"]
    assert (sd3["num_layers"], sd3["num_attention_heads"] * sd3["attention_head_dim"]) == (24, 1536)
    assert (flux["num_layers"], flux["num_single_layers"], flux["num_attention_heads"]) == (19, 38, 24)
    assert {c.model for c in pack.CASES} == set(pack.MODELS)
    assert any(c.checkpointing for c in pack.CASES if c.model == "flux1-dev")
    assert {c.objective for c in pack.CASES if c.model == "sd35m"} >= {"grpo", "nft"}


def test_gpu_check_isolates_each_model_in_a_process_of_its_own(tmp_path):
    """As on a GPU (where a CUDA fault ends the process): the model's cases run in a child process, whose rows come
    back to the report."""
    pack = load_pack()
    rows = pack.main(["--tiny", "--isolate", "--cases", "sd35m-grpo", "--out", str(tmp_path)])
    assert [r["case"] for r in rows] == ["sd35m-grpo"] and "error" not in rows[0], rows
    assert abs(rows[0]["ratio_first"] - 1) < 1e-5
    assert json.loads((tmp_path / "gpu_check.json").read_text())["rows"] == rows


def test_lower_bounds_are_the_oldest_versions_a_run_has_seen():
    """pyproject.toml's lower bounds of the libraries flowrl drives are the oldest versions it was seen to train with:
    the GPU check's recorded environment or this machine's, whichever is older (by major.minor)."""
    import importlib.metadata as md
    import re

    from packaging.version import Version

    root = Path(__file__).resolve().parents[1]
    text = (root / "pyproject.toml").read_text()
    seen = [
        json.loads(p.read_text())["environment"] for p in (root / "benchmarks" / "results").glob("gpu_check_*.json")
    ]
    assert seen, "no recorded GPU check"
    for name in ("torch", "diffusers", "transformers", "accelerate", "peft"):
        bound = Version(re.search(rf'"{name}>=([0-9.]+)"', text).group(1))
        versions = [Version(env[name].split("+")[0]) for env in seen] + [Version(md.version(name).split("+")[0])]
        oldest = min(versions)
        assert (bound.major, bound.minor) == (oldest.major, oldest.minor), (name, str(bound), str(oldest))


def test_save_model_writes_a_pipeline_the_rollout_benchmark_loads(tmp_path):
    """`--save-model` (what benchmarks/gpu_rollout.sh runs before benchmarks/rollout.py): the tiny version saves a
    pipeline flowrl loads and samples from; an unknown model name is refused naming the known ones."""
    import pytest

    from flowrl.families import load_image_backend

    pack = load_pack()
    threads = torch.get_num_threads()
    try:
        assert pack.main(["--tiny", "--out", str(tmp_path), "--save-model", "sd35m", str(tmp_path / "m")]) == []
        with pytest.raises(SystemExit, match="sd35m, flux1-dev"):
            pack.main(["--tiny", "--out", str(tmp_path), "--save-model", "sd4", str(tmp_path / "x")])
    finally:
        torch.set_num_threads(threads)
    backend = load_image_backend(str(tmp_path / "m"), "auto", dtype=torch.float32, device="cpu", max_sequence_length=16)
    assert backend.family == "sd3"
    out = backend.rollout(["a cat"], 1, num_steps=2, guidance_scale=1.0, height=32, width=32, seed=0, decode=False)
    assert torch.isfinite(out.final_latents).all()
