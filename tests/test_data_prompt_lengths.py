"""Prompts longer than the model's text encoders take: one flowrl warning per prompt set (how many are cut, to
how many tokens of which encoder, the first one's file:line), and none of the libraries' own truncation logs
(diffusers prints the cut text, hundreds of KB for a long prompt)."""

import warnings

from flowrl.config import load_config
from flowrl.train import Trainer

TINY = [
    "model.path=tiny-sd3",
    "model.device=cpu",
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=2",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=2",
    "eval.num_prompts=2",
    "log.progress=false",
]
LIBRARY_LOGS = ("was truncated", "Token indices sequence length")


def _trainer(overrides) -> tuple[Trainer, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(load_config(None, overrides))
    return trainer, [str(w.message) for w in caught if "are cut" in str(w.message)]


def test_a_long_prompt_is_one_warning_per_set_and_the_library_logs_are_silent(tmp_path, capfd):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n" + "0123456789" * 1000 + "\na blue dog\n")  # line 2: 10,000 characters
    held_out = tmp_path / "eval.txt"
    held_out.write_text("a cat\n" + "two dogs " * 40 + "\n" + "three birds " * 40 + "\n")
    trainer, messages = _trainer(
        [*TINY, f"log.run_dir={tmp_path / 'run'}", f"data.train_prompts={prompts}", f"data.eval_prompts={held_out}"]
    )
    train, evaluation = messages  # one warning per prompt set
    assert train.startswith("data.train_prompts: 1 of 3 prompts are too long for the model's text encoders")
    assert "1 to 16 CLIP tokens, 1 to 16 T5 tokens (sample.max_sequence_length)" in train
    assert f"the first is {prompts}:2 (10000 characters" in train
    assert evaluation.startswith("data.eval_prompts: 2 of 3 prompts") and f"{held_out}:2 " in evaluation
    trainer.policy.backend.encode_prompts(trainer.train_set.prompts + trainer.eval_set.prompts)  # the pipeline cuts
    out, err = capfd.readouterr()
    assert not any(log in out + err for log in LIBRARY_LOGS), (out + err)[:500]


def test_prompts_that_fit_give_no_warning_and_one_set_is_checked_once(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n" + "x" * 40 + "\na dog\n")
    _, messages = _trainer([*TINY, f"log.run_dir={tmp_path / 'a'}", f"data.train_prompts={prompts}"])
    assert len(messages) == 1 and messages[0].startswith("data.train_prompts: 1 of 3")  # eval = the same set
    prompts.write_text("a red cat\na dog\n")
    _, messages = _trainer([*TINY, f"log.run_dir={tmp_path / 'b'}", f"data.train_prompts={prompts}"])
    assert messages == []


def test_text_prompts_longer_than_max_prompt_length_warn(tiny_lm, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2=", "answer": "3"}\n' + '{"prompt": "' + "1+" * 40 + '1=", "answer": "41"}\n')
    _, messages = _trainer(
        [
            "backend=text",
            f"model.path={tiny_lm}",
            "model.device=cpu",
            f"data.train_prompts={prompts}",
            "rewards=[{name: accuracy}]",
            "sample.prompts_per_epoch=2",
            "text.max_prompt_length=16",
            f"log.run_dir={tmp_path / 'run'}",
        ]
    )
    (message,) = messages
    assert message.startswith(
        "data.train_prompts: 1 of 2 prompts are too long for the model's prompt length and are cut"
    )
    assert "1 to 16 tokens (text.max_prompt_length; a prompt's last tokens are kept)" in message
    assert f"the first is {prompts}:2 (82 characters, 83 tokens)" in message


def test_the_warning_names_the_cut_the_models_positions_make(tmp_path):
    """A model with fewer positions than text.max_prompt_length + max_new_tokens cuts prompts shorter: the warning
    names that length and why (it named text.max_prompt_length's 256)."""
    from conftest import save_tiny_gpt2

    lm = save_tiny_gpt2(tmp_path / "lm", n_positions=24)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2=", "answer": "3"}\n' + '{"prompt": "' + "1+" * 40 + '1=", "answer": "41"}\n')
    run = ["backend=text", f"model.path={lm}", "model.device=cpu", f"data.train_prompts={prompts}"]
    run += ["rewards=[{name: accuracy}]", "sample.prompts_per_epoch=2", "text.max_new_tokens=4"]
    _, messages = _trainer([*run, f"log.run_dir={tmp_path / 'run'}"])
    (message,) = messages
    assert "1 to 20 tokens (the model's positions less text.max_new_tokens, below text.max_prompt_length" in message
