"""Memory levers change memory, not the update: a minibatch split into micro-batches, and gradient checkpointing,
give the same gradient as the plain update (image and text), and the first minibatch stays on-policy."""

import pytest
import torch
from conftest import tiny_gpt2_overrides
from imagetiny import TINY_RUN

from flowrl.config import load_config
from flowrl.train import Trainer

TINY = [
    *TINY_RUN,
    "eval.num_steps=2",
    "eval.num_prompts=1",
    "train.grpo.clip_low=0.2",
]


def minibatch_grads(tr, batch, adv) -> list[torch.Tensor]:
    """The gradient the trainer's update accumulates for the whole batch as one minibatch."""
    tr.opt.zero_grad(set_to_none=True)
    units = tr.policy.train_units(batch, tr.cfg.train.steps_per_forward)
    n = sum(len(u) for u in units)
    idx, keep = torch.arange(len(adv)), torch.ones(len(adv), dtype=torch.bool)
    for unit in units:
        normalizer = tr.updater.minibatch_normalizer(batch, idx, unit, keep)
        for chunk in tr.updater.micro_batches(idx):
            out = tr.policy.unit_log_probs(batch, chunk, unit, with_reference=tr.cfg.train.grpo.beta > 0)
            loss, _ = tr.objective.loss(out, adv[chunk], keep[chunk], normalizer)
            (loss * (len(unit) / n)).backward()
    return [p.grad.detach().clone() for p in tr.params]


def block_calls(module: torch.nn.Module, fn) -> int:
    """How often `module` runs its forward during fn() (twice per pass when checkpointing recomputes it)."""
    calls = []
    handle = module.register_forward_pre_hook(lambda *args: calls.append(1))  # a recompute may stop early
    try:
        fn()
    finally:
        handle.remove()
    return len(calls)


def assert_same_grads(a, b, rtol=1e-5):
    top = max(g.abs().max().item() for g in a)
    assert top > 0
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= rtol * top, (x - y).abs().max().item() / top


def perturbed(tr):
    with torch.no_grad():  # lora_B starts at zero: move it so that every LoRA weight has a gradient
        for p in tr.params:
            p.add_(0.05 * torch.randn_like(p, generator=None))
    return tr


@pytest.mark.parametrize("extra", [[], ["train.grpo.beta=0.1", "train.steps_per_forward=2"]])
def test_image_micro_batches_give_the_minibatch_gradient(tmp_path, extra):
    torch.manual_seed(0)
    trainers = {
        m: Trainer(
            load_config(None, [*TINY, f"log.run_dir={tmp_path / str(m)}", f"train.micro_batch_size={m}", *extra])
        )
        for m in (0, 1, 2, 4)
    }
    for tr in trainers.values():
        torch.manual_seed(1)
        perturbed(tr)
    batch = trainers[0].rollout(epoch=0)
    adv = torch.linspace(-1.5, 1.5, len(batch.prompts))
    whole = minibatch_grads(trainers[0], batch, adv)
    for m in (1, 2, 4):
        assert_same_grads(minibatch_grads(trainers[m], batch, adv), whole)


def test_image_gradient_checkpointing_gives_the_same_gradient_and_stays_on_policy(tmp_path):
    plain = Trainer(load_config(None, [*TINY, f"log.run_dir={tmp_path / 'a'}", "train.grpo.beta=0.1"]))
    ckpt = Trainer(
        load_config(
            None, [*TINY, f"log.run_dir={tmp_path / 'b'}", "train.grpo.beta=0.1", "train.gradient_checkpointing=true"]
        )
    )
    assert ckpt.policy.backend.denoiser.gradient_checkpointing
    assert not plain.policy.backend.denoiser.gradient_checkpointing
    for tr in (plain, ckpt):
        torch.manual_seed(1)
        perturbed(tr)
    batch = plain.rollout(epoch=0)
    adv = torch.linspace(-1.5, 1.5, len(batch.prompts))
    assert_same_grads(minibatch_grads(ckpt, batch, adv), minibatch_grads(plain, batch, adv))
    # the checkpointed blocks really ran again in the backward pass
    runs = {
        name: block_calls(
            tr.policy.backend.denoiser.transformer_blocks[0], lambda tr=tr: minibatch_grads(tr, batch, adv)
        )
        for name, tr in (("plain", plain), ("ckpt", ckpt))
    }
    assert runs["ckpt"] > runs["plain"] > 0
    out = ckpt.update(ckpt.rollout(epoch=0), adv, torch.ones(len(adv), dtype=torch.bool), epoch=0)
    assert out["policy/ratio_first_dev"] <= 1e-5


def text_trainer(model_dir, run_dir, *extra):
    return Trainer(
        load_config(
            None,
            [
                *tiny_gpt2_overrides(model_dir),
                "sample.prompts_per_epoch=2",
                "sample.group_size=4",
                "text.max_new_tokens=5",
                "log.progress=false",
                f"log.run_dir={run_dir}",
                "train.grpo.beta=0.05",
                "text.entropy_coef=0.01",
                *extra,
            ],
        )
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_text_micro_batches_give_the_minibatch_gradient(tiny_lm, tmp_path, agg):
    trainers = {
        m: text_trainer(tiny_lm, tmp_path / str(m), f"train.micro_batch_size={m}", f"text.loss_agg={agg}")
        for m in (0, 3)
    }
    for tr in trainers.values():
        torch.manual_seed(1)
        perturbed(tr)
    for epoch in range(6):  # the first epoch whose completions differ in length (which one depends on the draws)
        batch = trainers[0].rollout(epoch=epoch)
        lengths = batch.completion_mask.sum(1)
        if len(set(lengths.tolist())) > 1:
            break
    assert len(set(lengths.tolist())) > 1, "completions of one length would not test the token normaliser"
    adv = torch.linspace(-1.5, 1.5, len(batch.prompts))
    assert_same_grads(minibatch_grads(trainers[3], batch, adv), minibatch_grads(trainers[0], batch, adv))


def test_text_gradient_checkpointing_gives_the_same_gradient_and_stays_on_policy(tiny_lm, tmp_path):
    plain, ckpt = (
        text_trainer(tiny_lm, tmp_path / n, f"train.gradient_checkpointing={c}")
        for n, c in (("a", "false"), ("b", "true"))
    )
    for tr in (plain, ckpt):
        torch.manual_seed(1)
        perturbed(tr)
    batch = plain.rollout(epoch=0)
    adv = torch.linspace(-1.5, 1.5, len(batch.prompts))
    assert_same_grads(minibatch_grads(ckpt, batch, adv), minibatch_grads(plain, batch, adv))
    assert not ckpt.policy.model.training  # back in eval mode after the forward
    # a module inside the block: transformers checkpoints the block's forward, inside its own hooks
    block = {tr: next(m for n, m in tr.policy.model.named_modules() if n.endswith("h.0.attn")) for tr in (plain, ckpt)}
    runs = {tr: block_calls(block[tr], lambda tr=tr: minibatch_grads(tr, batch, adv)) for tr in (plain, ckpt)}
    assert runs[ckpt] > runs[plain] > 0
    out = ckpt.update(ckpt.rollout(epoch=0), adv, torch.ones(len(adv), dtype=torch.bool), epoch=0)
    assert out["policy/ratio_first_dev"] <= 1e-5


def test_bf16_base_weights_with_fp32_lora_stay_on_policy(tmp_path):
    """Mixed precision: the frozen weights in bfloat16, the trained LoRA and the optimizer's states in float32, the
    step math in float32; the first minibatch is on-policy within the bf16 rollout's tolerance."""
    tr = Trainer(
        load_config(
            None,
            [
                *TINY,
                f"log.run_dir={tmp_path}",
                "model.dtype=bfloat16",
                "train.epochs=1",
                "eval.grid=false",
                "train.lr=1e-3",
            ],
        )
    )
    den = tr.policy.backend.denoiser
    frozen = [p for n, p in den.named_parameters() if "lora_" not in n]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert tr.params and all(p.dtype == torch.float32 for p in tr.params)
    metrics = tr.fit()
    assert metrics["policy/ratio_first_dev"] <= 1e-5  # measured: 0.0 on the CPU
    states = [s for st in tr.opt.state.values() for s in st.values() if torch.is_tensor(s) and s.ndim > 0]
    assert states and all(s.dtype == torch.float32 for s in states)
    assert all(p.dtype == torch.float32 for p in tr.params)


def test_parallel_strategy_follows_the_sharding_key_and_an_fsdp_accelerate_config():
    from accelerate.utils import DistributedType

    from flowrl.dist import detect as parallel_strategy

    plain, fsdp = load_config(None, []), load_config(None, ["train.sharding=fsdp"])
    assert parallel_strategy(plain, 1, DistributedType.NO) == "single"
    assert parallel_strategy(fsdp, 1, DistributedType.NO) == "single"  # one process: nothing to shard over
    assert parallel_strategy(plain, 8, DistributedType.MULTI_GPU) == "ddp"
    assert parallel_strategy(fsdp, 8, DistributedType.MULTI_GPU) == "fsdp"
    assert parallel_strategy(plain, 8, DistributedType.FSDP) == "fsdp"  # a user's own accelerate FSDP config
    assert parallel_strategy(plain, 8, DistributedType.DEEPSPEED) == "deepspeed"
