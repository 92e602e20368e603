"""scripts/shapes_pass_at_k.py: per family, the accuracy, pass@G and the mixed groups (a right and a wrong image),
against a hand count; and its measurement end to end on a few prompts of the shapes model."""

import json
from pathlib import Path

import pytest
from repo_files import load_module

ROOT = Path(__file__).resolve().parents[1]


def script():
    return load_module("scripts/shapes_pass_at_k.py", "pass_at_k")


def test_the_family_table_is_the_hand_count():
    families = ["a", "a", "a", "b"]
    correct = [[True, False], [False, False], [True, True], [False, True]]
    rows = script().family_table(families, correct)
    # a: 3 of 6 images right; 2 of 3 prompts hold a right one; 1 of 3 both kinds. b: 1 of 2, 1, 1.
    assert rows["a"] == {"prompts": 3, "accuracy": 0.5, "pass": pytest.approx(2 / 3), "mixed": pytest.approx(1 / 3)}
    assert rows["b"] == {"prompts": 1, "accuracy": 0.5, "pass": 1.0, "mixed": 1.0}
    assert rows["all"] == {  # the mean over the families, as GenEval's overall
        "accuracy": 0.5,
        "pass": pytest.approx(5 / 6),
        "mixed": pytest.approx(2 / 3),
        "prompts": 4,
    }


def test_it_measures_the_shapes_model_on_a_prompt_file(tmp_path):
    rows = [json.loads(line) for line in (ROOT / "samples" / "shapes" / "val.jsonl").read_text().splitlines()][:3]
    prompts = tmp_path / "three.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "pass.json"
    assert script().main(["--prompts", str(prompts), "--group", "2", "--json", str(out), "eval.num_steps=2"]) == 0
    result = json.loads(out.read_text())
    assert result["group"] == 2 and result["families"]["all"]["prompts"] == 3
    for row in result["families"].values():
        assert 0 <= row["mixed"] <= row["pass"] <= 1 and 0 <= row["accuracy"] <= 1
