"""benchmarks/text_step.py: the flowrl half runs one timed epoch on samples/arith and prints finite figures."""

import math

import torch
from repo_files import load_module


def test_text_step_benchmark_flowrl_half_runs(capsys):
    bench = load_bench()
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


def load_bench():
    return load_module("benchmarks/text_step.py", "text_step_bench")


def test_realistic_setting_builds_a_qwen2_with_a_32k_vocabulary(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    bench = load_bench()
    d = bench.build_realistic_model(str(tmp_path / "m"))
    cfg, tok = AutoConfig.from_pretrained(d), AutoTokenizer.from_pretrained(d)
    assert cfg.model_type == "qwen2" and cfg.vocab_size == len(tok) >= 32000 and 256 <= cfg.hidden_size <= 512
    prompt = bench.REALISTIC_TEMPLATE.format(prompt="12+34")
    ids = tok(prompt)["input_ids"]
    assert len(ids) == len(prompt) and tok.decode(ids) == prompt  # one token per character, round trip
    assert tok.decode([len(tok) - 1]).strip().startswith("w")  # the top ids decode to text too


def test_realistic_setting_and_generate_ab_run(capsys):
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        out = bench.main(
            [
                "--setting",
                "realistic",
                "--no-trl",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--prompts",
                "1",
                "--group",
                "2",
                "--max-new-tokens",
                "3",
            ]
        )
        ab = bench.main(["--generate-ab", "--warmup", "0", "--repeats", "1", "--prompts", "2", "--group", "2"])
    finally:
        torch.set_num_threads(threads)
    assert 0 < out["flowrl"]["tokens"] <= 1 * 2 * 3 and out["flowrl"]["step"] > 0
    assert len(ab["generate_ab"]) == 4 and all(math.isfinite(v) and v > 0 for v in ab["generate_ab"].values())
    printed = capsys.readouterr().out
    assert "realistic setting: 1 prompts x 2" in printed and "TRL's call: multinomial" in printed
