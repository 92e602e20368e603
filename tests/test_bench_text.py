"""benchmarks/text_step.py: the flowrl half runs one timed epoch on samples/arith and prints finite figures."""

import importlib.util
import math
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "text_step.py"


def test_text_step_benchmark_flowrl_half_runs(capsys):
    spec = importlib.util.spec_from_file_location("text_step_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        out = bench.main(["--no-trl", "--warmup", "0", "--repeats", "1", "--prompts", "4", "--group", "4"])
    finally:
        torch.set_num_threads(threads)
    fl = out["flowrl"]
    assert out["trl"] is None and out["threads"] == 1
    for key in (*bench.PHASES, "update/sample", "tok/s"):
        assert math.isfinite(fl[key]) and fl[key] > 0, (key, fl[key])
    assert 0 < fl["tokens"] <= 4 * 4 * 4  # prompts x group x max_new_tokens
    assert fl["rollout"] >= fl["generate"]
    printed = capsys.readouterr().out
    assert "TRL: skipped (--no-trl)" in printed and "rollout tokens/s" in printed and "[threads 1]" in printed
