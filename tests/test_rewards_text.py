"""Text rewards (TRL signature): accuracy, think_format, soft_overlong; completions as strings or chat."""

from __future__ import annotations

import asyncio

import pytest

import rewards
from rewards._common import RewardState, call_text_reward, completion_text
from rewards.accuracy import extract_answer, last_boxed, parse_number
from rewards.soft_overlong import soft_overlong_punishment
from rewards.think_format import think_format_reward


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_completion_text_reads_strings_and_chat_messages():
    assert completion_text("42") == "42"
    assert completion_text(chat("4") + [{"role": "tool", "content": "x"}] + chat("2")) == "42"
    assert (
        completion_text(
            [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        )
        == "ab"
    )
    with pytest.raises(TypeError, match="role', 'content"):
        completion_text(["not a message"])


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so \boxed{\frac{3}{4}} done", r"\frac{3}{4}"),
        (r"\boxed{1} then \boxed{{2}+1}", "{2}+1"),  # the last box, nested braces kept
        (r"\boxed 7", "7"),
        ("work...\n#### 1,234\nmore", "1,234"),  # GSM8K
        ("I got 3 apples and then 12.5 more", "12.5"),  # the last number
        ("half is 1/2", "1/2"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "text, value",
    [
        ("1,234", 1234.0),
        ("$5", 5.0),
        ("50\\%", 50.0),
        ("-2.5", -2.5),
        ("3/4", 0.75),
        (r"\frac{3}{4}", 0.75),
        (r"-\dfrac{1}{8}", -0.125),
        ("1e3", 1000.0),
        (".5", 0.5),
        (r"7 \text{ apples}", 7.0),
        ("x+1", None),
        ("1,2,3", None),
        (None, None),
        ("1/0", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_last_boxed_unbalanced_is_none():
    assert last_boxed(r"\boxed{1") is None


def test_accuracy_compares_numbers_and_skips_non_numeric_references():
    accuracy = rewards.get("accuracy")
    completions = [
        r"The answer is \boxed{72}.",  # solution has "#### 72" -> 1
        chat("<think>..</think><answer>So 0.75</answer>"),  # 3/4 = 0.75 -> 1
        "Total: 1,000 dollars",  # 1000 vs 1001 -> 0
        "I don't know",  # no number -> 0
        r"\boxed{x}",  # reference is not numeric -> None
    ]
    solutions = ["Natalia sold 48/2 = 24 clips... 48+24 = 72\n#### 72", r"\frac{3}{4}", "1001", "5", r"\pi"]
    assert accuracy(["q"] * 5, completions, solution=solutions) == [1.0, 1.0, 0.0, 0.0, None]
    assert accuracy(["q"], ["it is 2"], answer=[2]) == [1.0]  # GSM8K-style 'answer' column, int value
    assert accuracy.kind == "text" and accuracy.__name__ == "accuracy"


def test_accuracy_tolerance_is_relative():
    tight, loose = rewards.get("accuracy"), rewards.get("accuracy", rel_tol=1e-3)
    # |0.3333 - 1/3| / (1/3) = 1e-4: inside 1e-3, outside 1e-6
    assert tight(["q"], ["0.3333"], solution=["1/3"]) == [0.0]
    assert loose(["q"], ["0.3333"], solution=["1/3"]) == [1.0]


def test_accuracy_without_reference_column_names_what_it_needs():
    with pytest.raises(KeyError, match="'solution' or 'answer'.*got columns \\['label'\\]"):
        rewards.get("accuracy")(["q"], ["1"], label=["1"])


@pytest.mark.parametrize(
    "text, ok",
    [
        ("<think>reason</think><answer>4</answer>", True),
        ("\n<think>a\nb</think>\n\n<answer>\n4\n</answer>\n", True),
        ("<answer>4</answer><think>r</think>", False),  # wrong order
        ("<think>r</think>", False),  # no answer
        ("<think>r</think><answer>4</answer> trailing", False),
        ("<think>r<think>r</think><answer>4</answer>", False),  # a tag twice
        ("<think>r</think><answer>4</answer><answer>5</answer>", False),
        ("Sure! <think>r</think><answer>4</answer>", False),  # text before
    ],
)
def test_think_format(text, ok):
    assert think_format_reward(["q"], [text]) == [float(ok)]
    assert rewards.get("think_format")(["q"], [chat(text)]) == [float(ok)]


@pytest.mark.parametrize(
    "length, expected",
    [
        (10, 0.0),
        (15, 0.0),  # <= L_max - L_cache = 20 - 5 = 15
        (16, -0.2),  # (15 - 16) / 5
        (18, -0.6),  # (15 - 18) / 5
        (20, -1.0),  # (15 - 20) / 5, the end of the interval
        (21, -1.0),
        (100, -1.0),  # over L_max
    ],
)
def test_soft_overlong_punishment(length, expected):
    assert soft_overlong_punishment(length, max_length=20, cache_length=5) == pytest.approx(expected, abs=1e-12)


def test_soft_overlong_reads_completion_ids_or_a_tokenizer(tmp_path):
    from rewardtiny import save_tiny_clip

    reward = rewards.get("soft_overlong", max_length=8, cache_length=4)
    ids = [[1] * 3, [1] * 6, [1] * 9]  # threshold 4: 0, (4-6)/4 = -0.5, -1
    assert reward(["q"] * 3, ["", "", ""], completion_ids=ids) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="completion_ids.*tokenizer="):
        reward(["q"], ["text"])
    save_tiny_clip(tmp_path)  # a character-level tokenizer: one token per character
    by_text = rewards.get("soft_overlong", max_length=8, cache_length=4, tokenizer=str(tmp_path))
    assert by_text(["q"] * 3, ["abc", chat("abcdef"), "abcdefghi"]) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="0 < cache_length <= max_length"):
        rewards.get("soft_overlong", max_length=4, cache_length=8)
    # and before any model loads (the config's check), naming the reward
    with pytest.raises(rewards.RewardConfigError, match=r"reward 'soft_overlong' needs 0 < cache_length <= max_len"):
        rewards.check("soft_overlong", {"max_length": 4, "cache_length": 8}, "text")
    rewards.check("soft_overlong", {"max_length": 8, "cache_length": 4}, "text")


# ---------------------------------------------------------------------------- TRL reward functions, unchanged


def trl_scheduled_length(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL-style reward (GRPOTrainer passes trainer_state, log_metric, log_extra and the columns as kwargs):
    a length bonus that fades with training, logging its own metric and a column."""
    weight = 1.0 / (1 + trainer_state.global_step)
    lengths = [len(c) for c in completions]
    log_metric("mean_length", sum(lengths) / len(lengths))
    log_extra("target", list(kwargs["target"]))
    return [weight * n if t is not None else None for n, t in zip(lengths, kwargs["target"])]


def test_a_trl_reward_gets_trainer_state_log_metric_log_extra_and_columns():
    state, logs, extra = RewardState(global_step=3, epoch=1.0), {}, {}
    out = call_text_reward(
        trl_scheduled_length,
        ["p1", "p2"],
        ["abcd", "ab"],
        [[5, 6, 7], [8]],
        {"target": ["x", None]},
        state=state,
        logs=logs,
        extra=extra,
    )
    assert out == [1.0, None]  # 4 / (1 + 3); None: does not apply
    state.global_step = 1
    call_text_reward(
        trl_scheduled_length, ["p"], ["abcdef"], [[1]], {"target": ["y"]}, state=state, logs=logs, extra=extra
    )
    assert logs == {"mean_length": [3.0, 6.0]}  # (4 + 2) / 2, then 6
    assert extra == {"target": ["x", None, "y"]}


def test_only_the_arguments_a_reward_names_are_passed_unless_it_takes_kwargs():
    seen = {}

    def exact(prompts, completions, completion_ids):  # would fail on trainer_state etc.
        seen["ids"] = completion_ids
        return [float(len(ids)) for ids in completion_ids]

    def everything(**kwargs):
        seen["keys"] = sorted(kwargs)
        return [0.0] * len(kwargs["completions"])

    args = (["p", "q"], ["a", "b"], [[1, 2], [3]], {"answer": ["1", "2"]})
    assert call_text_reward(exact, *args, state=RewardState(), logs={}) == [2.0, 1.0]
    assert seen["ids"] == [[1, 2], [3]]
    call_text_reward(everything, *args, state=RewardState(), logs={})
    assert seen["keys"] == [
        "answer",
        "completion_ids",
        "completions",
        "log_extra",
        "log_metric",
        "prompts",
        "trainer_state",
    ]


def test_async_rewards_are_awaited_on_one_loop_even_from_a_running_loop():
    loops = []

    async def judge(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        loops.append(asyncio.get_running_loop())
        kwargs["log_metric"]("judge_calls", 1)
        return [0.5 for _ in completions]

    logs: dict[str, list[float]] = {}
    assert call_text_reward(judge, ["p"], ["a"], None, {}, state=RewardState(), logs=logs) == [0.5]

    async def notebook_cell():  # this thread's loop is already running
        return call_text_reward(judge, ["p", "q"], ["a", "b"], None, {}, state=RewardState(), logs=logs)

    assert asyncio.run(notebook_cell()) == [0.5, 0.5]
    assert logs == {"judge_calls": [1.0, 1.0]}
    assert loops[0] is loops[1]  # one loop across calls: an async client made on the first call stays usable


def test_bad_outputs_of_a_text_reward_name_it():
    def short(prompts, completions, **kwargs):
        return [1.0]

    def words(prompts, completions, **kwargs):
        return ["good" for _ in completions]

    with pytest.raises(ValueError, match=r"reward 'short' returned 1 scores for 2 completions"):
        call_text_reward(short, ["p", "q"], ["a", "b"], None, {}, state=RewardState(), logs={})
    with pytest.raises(
        ValueError, match=r"reward 'words' returned 'good' \(str\) for completion 0; scores are numbers or None"
    ):
        call_text_reward(words, ["p"], ["a"], None, {}, state=RewardState(), logs={})


def test_text_policy_calls_trl_rewards_and_pops_their_logs(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from flowrl.config import load_config
    from flowrl.policies.text import TextPolicy
    from flowrl.worlds.arith import arith_tokenizer

    tok = arith_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tok),
            n_positions=32,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = load_config(None, ["backend=text", f"model.path={tmp_path}", "model.device=cpu", "text.max_new_tokens=3"])
    policy = TextPolicy(cfg, "cpu")
    batch = policy.rollout(
        ["1+2=", "3+4="], [{"answer": "3"}, {"answer": "7"}], epoch=0, generator=torch.Generator().manual_seed(0)
    )
    seen = {}

    def trl_reward(prompts, completions, completion_ids, trainer_state, log_metric, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer)
        log_metric("step", trainer_state.global_step)
        return [None, float(trainer_state.epoch)]

    policy.reward_state.global_step, policy.reward_state.epoch = 4, 2.0  # as the trainer sets them
    scores = policy.call_reward(trl_reward, batch, {"answer": ["3", "7"]})
    assert seen == {
        "prompts": ["1+2=", "3+4="],
        "completions": batch.completions,
        "ids": batch.completion_id_lists,
        "answer": ["3", "7"],
    }
    assert torch.isnan(scores[0]) and scores[1] == 2.0 and scores.dtype == torch.float32
    policy.reward_state.global_step = 6
    policy.call_reward(trl_reward, batch, {"answer": ["3", "7"]})
    assert policy.pop_reward_logs() == {"reward_log/step": 5.0}  # mean of 4 and 6
    assert policy.pop_reward_logs() == {}  # cleared


def test_registered_text_rewards_through_the_trl_call():
    """The registry's rewards take the TRL call too; `weighted` names its first parameter otherwise
    (prompts_or_images), so it gets the batch positionally."""
    weighted = rewards.get("weighted", components={"accuracy": 1.0, "think_format": 0.25})
    completions = ["<think>r</think><answer>4</answer>", "4", "<think>r</think><answer>x</answer>"]
    out = call_text_reward(
        weighted,
        ["q"] * 3,
        completions,
        [[1], [1, 2], [1, 2, 3]],
        {"solution": ["4", "4", "pi"]},
        state=RewardState(),
        logs={},
    )
    assert out == [1.25, 1.0, 0.25]  # as test_weighted_text_sum_skips_none_like_trl
    overlong = rewards.build("soft_overlong", {"max_length": 2, "cache_length": 1}, "text")
    assert call_text_reward(
        overlong, ["q"] * 3, ["", "", ""], [[1], [1, 2], [1, 2, 3]], {}, state=RewardState(), logs={}
    ) == [0.0, -1.0, -1.0]  # (1 - 2) / 1 at L_max, -1 over it
