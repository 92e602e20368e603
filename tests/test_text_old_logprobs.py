"""text.old_log_probs=sampling: the rollout's old log-probs taken from generate()'s own decoding steps equal an
independent uncached forward's, the switch changes neither the samples nor the loss and gradients, and the
first minibatch's on-policy check still catches a sampler/trainer mismatch."""

import dataclasses

import pytest
import torch
from conftest import tiny_gpt2_overrides

from flowrl.config import ConfigError, load_config
from flowrl.policies.text import SampledLogProbs, position_ids_from_mask
from flowrl.train import Trainer


def text_cfg(model_dir, run_dir, *extra):
    return load_config(
        None,
        [
            *tiny_gpt2_overrides(model_dir),
            "sample.prompts_per_epoch=3",
            "sample.group_size=4",
            "text.max_new_tokens=6",
            "train.lr=1e-2",
            "log.progress=false",
            f"log.run_dir={run_dir}",
            "log.completions_every=0",
            *extra,
        ],
    )


def independent_log_probs(model, batch, temperature):
    """log softmax(logits / temperature)[y] of the completion tokens from one uncached float64 forward [B, T]."""
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from_mask(batch.attention_mask),
            use_cache=False,
        ).logits
    lp = torch.log_softmax(logits[:, batch.prompt_len - 1 : -1].double() / temperature, -1)
    return lp.gather(-1, batch.completion_ids[..., None]).squeeze(-1), logits[:, batch.prompt_len - 1 : -1]


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.8, 0), (1.0, 0.6, 5)])
def test_sampling_log_probs_equal_an_uncached_forward(tiny_lm, tmp_path, temperature, top_p, top_k):
    tr = Trainer(
        text_cfg(tiny_lm, tmp_path, f"text.temperature={temperature}", f"text.top_p={top_p}", f"text.top_k={top_k}")
    )
    assert tr.cfg.text.old_log_probs == "sampling"  # the default
    batch = tr.rollout(epoch=0)
    mask = batch.completion_mask
    assert mask.sum(1).max() > 1  # more than the prefill's step is compared
    want, logits = independent_log_probs(tr.policy.model, batch, temperature)
    torch.testing.assert_close(batch.old_log_probs.double(), want * mask, rtol=0, atol=1e-4)
    # and equal to the policy's own forward path
    fwd, _ = tr.policy._forward_log_probs(
        tr.policy.model, batch.input_ids, batch.attention_mask, batch.prompt_len, temperature
    )
    torch.testing.assert_close(batch.old_log_probs, fwd * mask, rtol=0, atol=1e-4)
    if top_p < 1:
        # truncation happened (the distribution sampled from renormalises over the nucleus), yet the recorded
        # log-probs are the untruncated ones the update computes: the comparison above can tell them apart
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        z = logits.reshape(-1, logits.shape[-1]).float() / temperature
        if top_k:
            z = TopKLogitsWarper(top_k)(None, z)
        z = TopPLogitsWarper(top_p)(None, z)
        truncated = torch.log_softmax(z.double(), -1).gather(-1, batch.completion_ids.reshape(-1, 1))
        truncated = truncated.view_as(want)
        assert torch.isfinite(truncated[mask > 0]).all()  # every sampled token lies in its nucleus
        assert (truncated - want)[mask > 0].abs().max() > 1e-2


def test_recorder_holds_one_step_and_counts_tokens():
    """Fed three steps by hand: each step's log-prob is taken once the next call reveals its token."""
    torch.manual_seed(0)
    steps = [torch.randn(2, 7) for _ in range(3)]
    tokens = torch.tensor([[1, 4, 6], [0, 2, 3]])
    rec = SampledLogProbs(0.5)
    prompt = torch.zeros(2, 3, dtype=torch.long)
    for t, z in enumerate(steps):
        assert rec(torch.cat([prompt, tokens[:, :t]], 1), z) is z  # the logits pass on unchanged
    got = rec.finish(torch.cat([prompt, tokens], 1), 3)
    want = torch.stack(
        [torch.log_softmax(z.double() / 0.5, -1).gather(1, tokens[:, t : t + 1])[:, 0] for t, z in enumerate(steps)], 1
    )
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="recorded 0 sampling steps for 2 generated tokens"):
        SampledLogProbs(1.0).finish(torch.zeros(2, 5, dtype=torch.long), 2)


def loss_and_grads(tr, batch, adv, keep):
    tr.opt.zero_grad(set_to_none=True)
    idx = torch.arange(len(batch.prompts))
    unit = tr.objective.train_units(batch, 1)[0]
    normalizer = tr.updater.minibatch_normalizer(batch, idx, unit, keep)
    loss, _ = tr.objective.unit_loss(batch, idx, unit, adv, keep, normalizer)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in tr.named_params.items()}


def test_switch_changes_neither_samples_nor_loss_and_gradients(tiny_lm, tmp_path):
    common = ("text.temperature=0.7", "text.top_p=0.9", "train.grpo.clip_low=0.1")
    tr_s = Trainer(text_cfg(tiny_lm, tmp_path / "s", "text.old_log_probs=sampling", *common))
    tr_f = Trainer(text_cfg(tiny_lm, tmp_path / "f", "text.old_log_probs=forward", *common))
    with torch.no_grad():  # the same moved adapter in both, so the ratio is not 1 and the clip acts
        for (n, p), (_, q) in zip(tr_s.named_params.items(), tr_f.named_params.items()):
            if "lora_B" in n:
                p.normal_(0, 0.3)
                q.copy_(p)
    b_s, b_f = tr_s.rollout(epoch=0), tr_f.rollout(epoch=0)
    assert torch.equal(b_s.completion_ids, b_f.completion_ids)  # the recorder draws nothing from the RNG
    torch.testing.assert_close(b_s.old_log_probs, b_f.old_log_probs, rtol=0, atol=1e-5)
    adv = torch.linspace(-1.5, 1.5, len(b_s.prompts))
    keep = torch.ones(len(b_s.prompts), dtype=torch.bool)
    loss_s, g_s = loss_and_grads(tr_s, b_s, adv, keep)
    loss_f, g_f = loss_and_grads(tr_f, b_f, adv, keep)
    assert loss_s.abs() > 1e-3
    torch.testing.assert_close(loss_s, loss_f, rtol=0, atol=1e-6)
    assert max(g.abs().max() for g in g_f.values()) > 1e-3
    for n in g_f:
        torch.testing.assert_close(g_s[n], g_f[n], rtol=1e-4, atol=1e-6, msg=n)
    # the test can fail: old log-probs off by 0.05 nats move the loss and the gradients far beyond the tolerances
    loss_x, g_x = loss_and_grads(tr_f, dataclasses.replace(b_f, old_log_probs=b_f.old_log_probs - 0.05), adv, keep)
    assert (loss_x - loss_f).abs() > 1e-4
    assert max((g_x[n] - g_f[n]).abs().max() for n in g_f) > 1e-4


def test_first_minibatch_check_catches_a_temperature_mismatch(tiny_lm, tmp_path):
    tr = Trainer(text_cfg(tiny_lm, tmp_path, "text.temperature=0.7"))
    batch = tr.rollout(epoch=0)
    adv = torch.linspace(-1.0, 1.0, len(batch.prompts))
    keep = torch.ones(len(batch.prompts), dtype=torch.bool)
    matched = tr.update(batch, adv, keep, epoch=0)
    assert matched["policy/ratio_first_dev"] <= 1e-5
    batch = tr.rollout(epoch=1)
    tr.cfg.text.temperature = 1.0  # the update now computes log-probs under another temperature than sampled
    with pytest.warns(UserWarning, match="the first minibatch is not on-policy"):
        mismatched = tr.update(batch, adv, keep, epoch=1)
    assert mismatched["policy/ratio_first_dev"] > 1e-2


def test_unknown_old_log_probs_source_lists_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"text\.old_log_probs: 'cached' is not a valid choice; valid: sampling, forward"
    ):
        load_config(None, ["backend=text", "text.old_log_probs=cached", "rewards=[{name: accuracy}]"])


@pytest.fixture(scope="module")
def hostile_lm(tiny_lm, tmp_path_factory):
    """The tiny GPT-2 whose generation_config.json would reshape sampling (as Qwen2.5-Instruct's does): a
    repetition penalty, no repeated tokens, top-k 1, a low temperature."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("hostile") / "lm"
    shutil.copytree(tiny_lm, d)
    gen = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    gen.update(do_sample=True, repetition_penalty=3.0, no_repeat_ngram_size=1, top_k=1, temperature=0.2, top_p=0.5)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def nucleus_probs(logits, temperature, top_p):
    """softmax(logits / temperature) kept on the smallest set of most probable tokens whose mass reaches top_p,
    renormalised [V] (written out here, not transformers' warper)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    before = torch.cumsum(p[order], 0) - p[order]  # mass of the tokens ranked above
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[before < top_p]] = True
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def test_rollout_draws_the_tempered_nucleus_whatever_the_model_generation_config(hostile_lm, tmp_path):
    n, temperature, top_p = 3000, 0.7, 0.8
    tr = Trainer(
        text_cfg(
            hostile_lm, tmp_path, f"text.temperature={temperature}", f"text.top_p={top_p}", "text.max_new_tokens=1"
        )
    )
    prompt = "12+21="
    batch = tr.policy.rollout([prompt] * n, [{"answer": "33"}] * n, epoch=0, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ids, attn = tr.policy.encode_prompts([prompt])
        logits = tr.policy.model(input_ids=ids, attention_mask=attn).logits[0, -1]
    want = nucleus_probs(logits, temperature, top_p)
    assert (want > 0).sum() >= 3  # a real draw among several tokens, not the model config's top-k 1
    freq = torch.bincount(batch.completion_ids[:, 0], minlength=len(want)).double() / n
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 4.5 * sigma + 1e-12).all(), (freq, want)
    # and the untruncated tempered softmax would have been told apart
    full = torch.softmax(logits.double() / temperature, -1)
    assert ((freq - full).abs() > 4.5 * (full * (1 - full) / n).sqrt()).any()


def test_model_generation_config_leaves_the_recorded_log_probs_alone(hostile_lm, tmp_path):
    tr = Trainer(text_cfg(hostile_lm, tmp_path, "text.temperature=1.0"))
    batch = tr.rollout(epoch=0)
    assert batch.completion_mask.sum(1).max() > 2
    want, _ = independent_log_probs(tr.policy.model, batch, 1.0)
    torch.testing.assert_close(batch.old_log_probs.double(), want * batch.completion_mask, rtol=0, atol=1e-4)


def test_forward_puts_only_the_completion_positions_through_the_lm_head(tiny_lm, tmp_path):
    """The update's forward: the LM head sees T + 1 positions per row (not the prompt's), the log-probs unchanged."""
    tr = Trainer(text_cfg(tiny_lm, tmp_path, "text.temperature=0.7"))
    batch = tr.rollout(epoch=0)
    seen = []
    head = tr.policy.base_model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    try:
        lp, _ = tr.policy._forward_log_probs(
            tr.policy.model, batch.input_ids, batch.attention_mask, batch.prompt_len, 0.7
        )
    finally:
        hook.remove()
    n_rows, n_new = batch.completion_ids.shape
    assert batch.prompt_len > 1 and seen == [(n_rows, n_new + 1, head.in_features)]
    want, _ = independent_log_probs(tr.policy.model, batch, 0.7)
    torch.testing.assert_close(lp.double() * batch.completion_mask, want * batch.completion_mask, rtol=0, atol=1e-5)


def test_repeated_prompts_encode_as_one_call_per_row_would(tiny_lm, tmp_path):
    """encode_prompts tokenizes each distinct prompt once: the same ids and mask as the tokenizer on every row."""
    tr = Trainer(text_cfg(tiny_lm, tmp_path))
    prompts = ["12+21=", "3+4=", "12+21=", "110+2=", "3+4=", "12+21="]
    ids, attn = tr.policy.encode_prompts(prompts)
    tok = tr.policy.tokenizer
    want = tok(
        prompts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=tr.cfg.text.max_prompt_length,
        add_special_tokens=True,
    )
    assert tok.padding_side == "left" and attn.min() == 0  # rows of different lengths, left-padded
    assert torch.equal(ids, want["input_ids"]) and torch.equal(attn, want["attention_mask"])
