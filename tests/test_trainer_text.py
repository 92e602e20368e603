"""The text backend on the same loop: a tiny GPT-2 really trains, and each loss preset equals its published
formula written out independently here on fixed log-probs."""

import json
import math
import re
from types import SimpleNamespace

import torch
from conftest import count_reference_entries, perturb_lora_b, tiny_gpt2_overrides

from flowrl.config import LOSS_PRESETS, load_config
from flowrl.objectives.grpo import grpo_loss
from flowrl.policies.base import UnitOutput
from flowrl.train import Trainer
from flowrl.train.scoring import combine_advantages


def text_cfg(model_dir, run_dir, *extra):
    return load_config(
        None,
        [
            *tiny_gpt2_overrides(model_dir),
            "sample.prompts_per_epoch=3",
            "sample.group_size=4",
            "text.max_new_tokens=4",
            "train.lr=1e-2",
            "log.progress=false",
            "eval.num_prompts=6",
            f"log.run_dir={run_dir}",
            "log.completions_every=1",
            *extra,
        ],
    )


def test_text_grpo_trains_a_tiny_gpt2(tiny_lm, tmp_path):
    cfg = text_cfg(
        tiny_lm,
        tmp_path,
        "train.epochs=2",
        "train.grpo.beta=0.05",
        "train.inner_epochs=2",
        "text.entropy_coef=0.01",
        "rewards=[{name: accuracy}, {name: soft_overlong, weight: 0.5, kwargs: {max_length: 4, cache_length: 2}}]",
    )
    tr = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    assert before and all("lora" in n for n in before)
    tr.fit()
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.named_params.items()) > 1e-6
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "policy/loss" in r]
    assert len(epochs) == 2
    for r in epochs:
        assert r["policy/ratio_first_dev"] <= 1e-5
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)
        assert "policy/entropy" in r and "policy/kl" in r
    table = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(table) == 2 * 12 and set(table[0]) >= {"prompt", "completion", "rewards", "advantage"}
    assert (tmp_path / "ckpt-000002" / "lora" / "adapter_config.json").exists()


def test_text_cache_reference_keeps_the_reference_log_probs_for_the_second_pass(tiny_lm, tmp_path):
    """train.cache_reference with two passes: the reference's token log-probs of each completion are computed in
    the first pass and read in the second (the same tokens), and the epoch trains the same weights as without."""
    runs = {}
    for cached in (False, True):
        tr = Trainer(
            text_cfg(
                tiny_lm,
                tmp_path / str(cached),
                "train.grpo.beta=0.5",
                "train.inner_epochs=2",
                "train.minibatch_size=4",
                f"train.cache_reference={str(cached).lower()}",
            )
        )
        perturb_lora_b(tr)
        calls = count_reference_entries(tr.policy)
        batch = tr.rollout(0)
        scores, _ = tr.score(batch, 0)
        adv, keep, _ = tr.advantages(batch, scores, 0)
        start = {n: p.detach().clone() for n, p in tr.named_params.items()}
        tr.update(batch, adv, keep, epoch=0)
        change = max((p.detach() - start[n]).abs().max().item() for n, p in tr.named_params.items())
        assert change > 1e-5  # it trained
        runs[cached] = (tr, len(calls), {n: p.detach().clone() for n, p in tr.named_params.items()}, batch)
    (_, plain_calls, plain_w, _), (tr, cached_calls, cached_w, batch) = runs[False], runs[True]
    assert plain_calls > 0 and cached_calls * 2 == plain_calls
    cache = tr.objective.reference_cache
    assert len(cache) == len(batch.prompts) == cache.hits
    assert max((cached_w[n] - plain_w[n]).abs().max().item() for n in plain_w) <= 1e-5
    sample, kept = next(iter(cache.items()))
    idx = torch.tensor([sample])
    with torch.no_grad(), tr.policy.reference() as ref:
        fresh = tr.policy._forward_log_probs(
            ref, batch.input_ids[idx], batch.attention_mask[idx], batch.prompt_len, tr.policy.text.temperature
        )[0][0]
    mask = batch.completion_mask[sample].bool()
    torch.testing.assert_close(kept[mask], fresh[mask], rtol=1e-5, atol=1e-6)


def test_completion_mask_and_recorded_log_probs(tiny_lm, tmp_path):
    tr = Trainer(text_cfg(tiny_lm, tmp_path, "text.temperature=0.7"))
    batch = tr.rollout(epoch=0)
    eos = tr.policy.tokenizer.eos_token_id
    for ids, m, trunc in zip(batch.completion_ids, batch.completion_mask, batch.truncated):
        n = int(m.sum())
        hits = (ids == eos).nonzero().flatten().tolist()
        if trunc:
            assert not hits and n == len(ids)
        else:
            assert hits[0] == n - 1  # the mask runs through the first EOS, inclusive
    # old log-probs equal an independent full log-softmax under the temperature, on the masked tokens
    with torch.no_grad():
        logits = tr.policy.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0),
        ).logits
        lp = torch.log_softmax(logits[:, batch.prompt_len - 1 : -1].double() / 0.7, -1)
        want = lp.gather(-1, batch.completion_ids[..., None]).squeeze(-1) * batch.completion_mask
    torch.testing.assert_close(batch.old_log_probs.double(), want, rtol=0, atol=1e-5)


def test_kl_in_reward_lowers_the_total_reward(tiny_lm, tmp_path):
    tr = Trainer(text_cfg(tiny_lm, tmp_path, "train.grpo.beta=0.5", "text.kl_in_reward=true", "text.kl_estimator=k1"))
    with torch.no_grad():
        for n, p in tr.named_params.items():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    batch = tr.rollout(epoch=0)
    # k1 summed over the completion, times beta, from an independent reference forward (adapter off)
    with torch.no_grad(), tr.policy.model.disable_adapter():
        ref = tr.policy.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0),
        ).logits
    ref_lp = (
        torch.log_softmax(ref[:, batch.prompt_len - 1 : -1].double(), -1)
        .gather(-1, batch.completion_ids[..., None])
        .squeeze(-1)
    )
    want = 0.5 * ((batch.old_log_probs.double() - ref_lp) * batch.completion_mask).sum(1)
    torch.testing.assert_close(batch.kl_penalty.double(), want, rtol=0, atol=1e-4)
    assert batch.kl_penalty.abs().max() > 0


# ----------------------------------------------------------------------------------- presets vs papers

G, T = 4, 5
LOGP = torch.tensor(
    [
        [-1.0, -0.5, -2.0, -0.1, -0.3],
        [-0.2, -1.5, -0.7, -0.9, -1.1],
        [-0.4, -0.4, -0.8, -1.2, -0.6],
        [-1.3, -0.2, -0.5, -0.5, -0.9],
    ],
    dtype=torch.float64,
)
OLD = LOGP - torch.tensor(
    [
        [0.1, -0.3, 0.0, 0.25, 0.05],
        [0.0, 0.2, -0.1, 0.3, 0.0],
        [-0.05, 0.15, 0.1, 0.0, -0.2],
        [0.4, 0.0, -0.3, 0.1, 0.2],
    ],
    dtype=torch.float64,
)
REF = LOGP + torch.tensor(
    [[0.2, 0.1, -0.1, 0.0, 0.3], [-0.2, 0.0, 0.1, 0.1, 0.0], [0.0, -0.3, 0.2, 0.1, 0.1], [0.1, 0.1, 0.0, -0.2, 0.0]],
    dtype=torch.float64,
)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=torch.float64)


def ours(preset):
    cfg = load_config(None, ["backend=text", f"text.loss_preset={preset}", "rewards=[{name: accuracy}]"])
    adv = combine_advantages(cfg, REWARDS[:, None], torch.zeros(G, dtype=torch.long), ["p"] * G, None)
    logp = LOGP.clone().requires_grad_()
    kl = None
    if cfg.train.grpo.beta > 0:
        from flowrl.core import kl_estimate

        kl = kl_estimate(logp, REF, cfg.text.kl_estimator)
    out = UnitOutput(log_prob=logp, old_log_prob=OLD, mask=MASK, kl=kl)
    loss, _ = grpo_loss(out, adv, torch.ones(G, dtype=torch.bool), cfg.train.grpo, cfg.text.loss_agg)
    loss.backward()
    return loss.item(), logp.grad


def assert_preset_matches(preset, loss_fn):
    """Our loss for `preset` and its gradient w.r.t. the log-probs equal the written-out formula's (1e-9)."""
    want, g_want = grad_of(loss_fn)
    got, g_got = ours(preset)
    assert abs(got - want) < 1e-9
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-9)


def grad_of(fn):
    logp = LOGP.clone().requires_grad_()
    value = fn(logp)
    value.backward()
    return value.item(), logp.grad


def mean(xs):
    return sum(xs) / len(xs)


def grpo_advantages():
    """A_i = (r_i - mean r) / (sample std of r + 1e-6), written out."""
    r = REWARDS.tolist()
    mu = mean(r)
    sd = math.sqrt(sum((x - mu) ** 2 for x in r) / (G - 1))
    return [(x - mu) / (sd + 1e-6) for x in r]


def test_grpo_preset_is_deepseekmath_objective():
    # A_i = (r_i - mean r) / std(r) (sample std); J = 1/G sum_i 1/|o_i| sum_t [min(rho A, clip(rho, .8, 1.2) A)
    #       - beta (pi_ref/pi - log(pi_ref/pi) - 1)], beta = 0.04; loss = -J
    A = grpo_advantages()

    def loss(logp):
        per_seq = []
        for i in range(G):
            terms = []
            for t in range(T):
                if MASK[i, t]:
                    rho = torch.exp(logp[i, t] - OLD[i, t])
                    surr = torch.minimum(rho * A[i], torch.clamp(rho, 0.8, 1.2) * A[i])
                    q = torch.exp(REF[i, t] - logp[i, t])
                    terms.append(surr - 0.04 * (q - torch.log(q) - 1))
            per_seq.append(sum(terms) / len(terms))
        return -sum(per_seq) / G

    assert_preset_matches("grpo", loss)


def test_dapo_preset_is_token_level_clip_higher():
    # J = 1 / sum_i |o_i| * sum_i sum_t min(rho A, clip(rho, 1 - .2, 1 + .28) A); no KL
    A = grpo_advantages()

    def loss(logp):
        terms = [
            torch.minimum(
                torch.exp(logp[i, t] - OLD[i, t]) * A[i],
                torch.clamp(torch.exp(logp[i, t] - OLD[i, t]), 0.8, 1.28) * A[i],
            )
            for i in range(G)
            for t in range(T)
            if MASK[i, t]
        ]
        return -sum(terms) / len(terms)

    assert_preset_matches("dapo", loss)
    assert LOSS_PRESETS["dapo"]["train"]["drop_zero_adv_groups"] and LOSS_PRESETS["dapo"]["text"]["mask_truncated"]


def test_dr_grpo_preset_has_no_std_and_a_constant_normaliser():
    # A_i = r_i - mean r; J = 1/G sum_i (1/T_max) sum_t min(rho A, clip(rho) A), T_max = the padded length
    A = [x - mean(REWARDS.tolist()) for x in REWARDS.tolist()]

    def loss(logp):
        per_seq = [
            sum(
                torch.minimum(
                    torch.exp(logp[i, t] - OLD[i, t]) * A[i],
                    torch.clamp(torch.exp(logp[i, t] - OLD[i, t]), 0.8, 1.2) * A[i],
                )
                for t in range(T)
                if MASK[i, t]
            )
            / T
            for i in range(G)
        ]
        return -sum(per_seq) / G

    assert_preset_matches("dr_grpo", loss)


def test_gspo_preset_is_the_sequence_ratio_objective():
    # s_i = exp(1/|o_i| sum_t (log pi - log pi_old)); J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i)
    A = grpo_advantages()

    def loss(logp):
        out = []
        for i in range(G):
            idx = [t for t in range(T) if MASK[i, t]]
            s = torch.exp(sum(logp[i, t] - OLD[i, t] for t in idx) / len(idx))
            out.append(torch.minimum(s * A[i], torch.clamp(s, 1 - 3e-4, 1 + 4e-4) * A[i]))
        return -sum(out) / G

    assert_preset_matches("gspo", loss)


def test_none_rewards_are_left_out_of_the_sum():
    cfg = load_config(None, ["backend=text", "rewards=[{name: accuracy}, {name: think_format, weight: 2}]"])
    scores = torch.tensor([[1.0, float("nan")], [0.0, 1.0], [float("nan"), 0.0], [1.0, 1.0]], dtype=torch.float64)
    adv = combine_advantages(cfg, scores, torch.zeros(4, dtype=torch.long), ["p"] * 4, None)
    # totals with None left out: [1, 2, 0, 3] -> mean 1.5, sample std sqrt(5/3)
    total = torch.tensor([1.0, 2.0, 0.0, 3.0], dtype=torch.float64)
    want = (total - 1.5) / (math.sqrt(5 / 3) + 1e-6)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-9)
    assert not torch.isnan(adv).any()
    _ = SimpleNamespace  # (kept for readers: grpo_loss takes plain config objects)


def test_truncated_completions_masked_and_chat_template(tiny_lm, tmp_path):
    tr = Trainer(text_cfg(tiny_lm, tmp_path, "text.mask_truncated=true", "text.max_new_tokens=2"))
    batch = tr.rollout(epoch=0)
    assert batch.truncated.any()  # 2 tokens cannot hold most sums and their EOS
    out = tr.policy.unit_log_probs(batch, torch.arange(len(batch.prompts)), [0, 1], with_reference=False)
    assert torch.equal(out.mask[batch.truncated], torch.zeros_like(out.mask[batch.truncated]))
    assert torch.equal(out.mask[~batch.truncated], batch.completion_mask[~batch.truncated])
    # a tokenizer with a chat template wraps the prompt in it
    pol = tr.policy
    assert pol.format_prompt("1+2=") == "1+2="  # the arithmetic tokenizer has none
    pol.tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}="
    pol.use_chat = True
    assert pol.format_prompt("1+2=") == "<user>1+2=="


def test_gdpo_combination_fills_none_with_the_group_mean():
    from flowrl.core import gdpo_advantages

    cfg = load_config(
        None,
        ["backend=text", "train.reward_combine=gdpo", "rewards=[{name: accuracy}, {name: think_format, weight: 0.5}]"],
    )
    nan = float("nan")
    scores = torch.tensor([[1.0, nan], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    adv = combine_advantages(cfg, scores, torch.zeros(4, dtype=torch.long), ["p"] * 4, None)
    # the None of sample 0's second reward takes its group's mean of that reward, (1 + 0 + 0) / 3
    filled = torch.tensor([[1.0, 1 / 3], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, gdpo_advantages(filled, [0] * 4, weights=[1.0, 0.5]), rtol=0, atol=1e-12)


TRL_REWARD = '''
import asyncio

seen_steps = []

def length_bonus(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, answer, **kwargs):
    """A TRL-style reward: reads trainer_state and a dataset column, logs a metric and an extra column."""
    seen_steps.append((trainer_state.global_step, trainer_state.epoch))
    log_metric("mean_len", sum(len(c) for c in completions) / len(completions))
    log_extra("answer_seen", list(answer))
    return [float(len(ids)) / 4 for ids in completion_ids]

async def async_zero(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [None if i % 4 == 0 else 0.0 for i in range(len(completions))]

def half_none(prompts, completions, **kwargs):
    return [None if i % 2 == 0 else 11.0 for i in range(len(completions))]
'''


def test_trl_reward_functions_work_unchanged_in_the_loop(tiny_lm, tmp_path, monkeypatch):
    """A TRL reward file plugged in by path: it sees trainer_state (the optimizer steps so far) and the dataset's
    columns, its log_metric lands in metrics.jsonl and its log_extra in completions.jsonl; an async one is
    awaited."""
    import sys

    (tmp_path / "trl_rewards.py").write_text(TRL_REWARD)
    monkeypatch.chdir(tmp_path)
    cfg = text_cfg(
        tiny_lm,
        tmp_path / "run",
        "train.epochs=2",
        "eval.grid=false",
        "rewards=[{name: 'trl_rewards.py:length_bonus'}, {name: 'trl_rewards.py:async_zero', weight: 0.5}]",
    )
    tr = Trainer(cfg)
    tr.fit()
    module = next(
        m
        for name, m in sys.modules.items()
        if name.endswith("trl_rewards") or getattr(m, "__file__", "") == str(tmp_path / "trl_rewards.py")
    )
    assert (0, 0.0) in module.seen_steps and any(step >= 1 and ep == 1.0 for step, ep in module.seen_steps), (
        module.seen_steps
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "policy/loss" in r]
    assert all(r["reward_log/mean_len"] > 0 for r in epochs)
    assert all(r["reward/async_zero_applies"] == 0.75 for r in epochs)  # None: does not apply
    table = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert all(row["answer_seen"] == str(int(row["prompt"][:2]) + int(row["prompt"][3:5])) for row in table)


def test_the_reward_total_leaves_out_the_samples_no_reward_applies_to(tiny_lm, tmp_path, monkeypatch):
    """reward/total_mean (the progress bar's and the curves' figure) is over the samples that train: one to which
    no weighted reward applies (None) is left out of the advantages, and of the mean too (it counted as 0)."""
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARD)
    monkeypatch.chdir(tmp_path)
    cfg = text_cfg(tiny_lm, tmp_path / "run", "train.epochs=1", "rewards=[{name: 'trl_rewards.py:half_none'}]")
    Trainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in rows if "policy/loss" in r)
    assert epoch["reward/half_none_applies"] == 0.5 and epoch["reward/half_none_mean"] == 11.0
    assert epoch["reward/total_mean"] == 11.0


def test_the_text_eval_leaves_an_infinite_score_out_of_its_mean(tiny_lm, tmp_path):
    """A text reward returning inf for one completion and None for another: None does not apply (as in training: no
    score, left out of the mean without a warning, the share that has one logged), the inf is left out of the
    eval's mean and counted as a failure (not turned into the largest float)."""
    import pytest

    (tmp_path / "inf_text.py").write_text(
        "def fn(prompts, completions, **kwargs):\n    return [float('inf'), None] + [1.0] * (len(completions) - 2)\n"
    )
    cfg = text_cfg(tiny_lm, tmp_path / "run", f"rewards=[{{name: '{tmp_path / 'inf_text.py'}:fn'}}]")
    tr = Trainer(cfg)
    outputs, scores = tr.evaluator.sample(tr.policy, tr.scorer.fns)
    name = cfg.rewards[0].name
    assert scores[name][0].item() == float("inf") and math.isnan(scores[name][1].item())
    with pytest.warns(UserWarning, match=rf"not finite .*\({re.escape(name)} 1 of {len(outputs)}\)"):
        results = tr.evaluator.results(outputs, scores, base_dir=None, this_is_base=True)
    assert results[f"eval/{name}_nonfinite"] == 1  # the inf alone
    assert results[f"eval/{name}_mean"] == 1.0  # the 1s alone
    assert results[f"eval/{name}_applies"] == pytest.approx((len(outputs) - 1) / len(outputs))
    path = tr.policy.save_eval_outputs(outputs, tr.evaluator.prompts, tmp_path / "ev", scores[name])
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # strict JSON: no Infinity, no NaN
    assert [r["score"] for r in rows[:3]] == [None, None, 1.0]


def test_lora_init_path_starts_a_text_run_from_an_exported_adapter(tiny_lm, tmp_path):
    """lora.init_path on the text backend: a run starts from another run's exported adapter (peft's format,
    adapter_config.json beside it), the very weights; one made with another alpha or rank is refused, naming the
    setting that takes it."""
    import pytest

    from flowrl.config import ConfigError
    from flowrl.preflight import PreflightError

    first = Trainer(text_cfg(tiny_lm, tmp_path / "a", "lora.alpha=16"))
    with torch.no_grad():  # lora_B starts at zero: as if trained
        for n, p in first.named_params.items():
            p.add_(0.01 * torch.randn_like(p))
    trained = {n: p.detach().clone() for n, p in first.named_params.items()}
    lora = tmp_path / "a" / "lora"
    first.policy.export(lora)  # what a checkpoint's lora/ holds
    second = Trainer(text_cfg(tiny_lm, tmp_path / "b", f"lora.init_path={lora}", "lora.alpha=16"))
    assert set(second.named_params) == set(trained)
    for n, p in second.named_params.items():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=0)
    fresh = Trainer(text_cfg(tiny_lm, tmp_path / "c", "lora.alpha=16"))
    assert any((p.detach() - trained[n]).abs().max() > 0 for n, p in fresh.named_params.items())
    with pytest.raises(PreflightError, match=r"made with lora alpha 16 .* lora\.alpha is 8: set lora\.alpha=16"):
        Trainer(text_cfg(tiny_lm, tmp_path / "d", f"lora.init_path={lora}", "lora.alpha=8"))
    with pytest.raises(ConfigError, match=r"holds a LoRA of rank 8, this config's lora\.rank is 4"):
        Trainer(text_cfg(tiny_lm, tmp_path / "e", f"lora.init_path={lora}", "lora.alpha=16", "lora.rank=4"))


def test_a_text_evals_settings_name_what_its_completions_depend_on(tiny_lm, tmp_path):
    """A text run's eval settings (which a base eval must share to be compared with) hold the text settings its greedy
    completions depend on: a base made at other max_new_tokens is not the base of this eval."""
    from flowrl.eval.diversity import TEXT_EVAL_KEYS, eval_settings, settings_differences

    cfg = text_cfg(tiny_lm, tmp_path / "run")
    short = text_cfg(tiny_lm, tmp_path / "run", "text.max_new_tokens=2")
    a, b = (eval_settings(["1+1="], [{}], c.eval, c.sample, c.text) for c in (cfg, short))
    assert all(f"text.{k}" in a for k in TEXT_EVAL_KEYS)
    assert settings_differences(a, b) == [f"text.max_new_tokens: {cfg.text.max_new_tokens!r} (base) vs 2"]
    assert not any(k.startswith("text.") for k in eval_settings(["x"], [{}], cfg.eval, cfg.sample))  # (images)
