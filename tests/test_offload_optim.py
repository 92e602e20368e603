"""train.offload (text encoders, VAE and reward models parked in CPU memory; optimizer states, float32 master
weights and the EMA on the CPU), float32 master weights for weights that are not float32, and the 8-bit AdamW.

This machine has no accelerator, so "the device" is the CPU too: the offload tests record which modules are
moved, where to, and when (around the encode, the decode and the reward), and check that an offloaded run
ends with the very weights of a plain one. What memory it saves on a GPU is the planner's estimate."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.config import load_config
from flowrl.offload import Parked, modules_in
from flowrl.train import Trainer
from flowrl.train.optim import MasterWeightsOptimizer, build_optimizer

torch.set_num_threads(1)
print("torch threads:", torch.get_num_threads())

TINY = [
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=4",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=4",
    "eval.num_steps=3",
    "eval.num_prompts=2",
    "log.progress=false",
    "model.device=cpu",
    "train.lr=3e-3",
    "train.grpo.clip_low=0.2",
    "eval.grid=false",
]

PLUGIN = '''
import torch

class Scorer:
    """A reward with a network of its own: the mean of a linear map of the image's pixels."""
    def __init__(self):
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)
        self.seen_on = []

    def __call__(self, images, prompts, **columns):
        self.seen_on.append(next(self.net.parameters()).device)
        import numpy as np
        x = torch.tensor(np.stack([np.asarray(im, dtype=np.float32) / 255 for im in images]))  # [B, H, W, 3]
        return self.net(x).mean(dim=(1, 2, 3)).tolist()

scorer = Scorer()
'''


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra])


# ----------------------------------------------------------------------------- the optimizers


def test_master_weights_step_bf16_weights_in_float32():
    """bf16 weights are stepped through float32 masters: after 3 AdamW steps the masters equal a float32 AdamW
    run on float32 copies of the same weights and gradients (exactly), the weights are the masters rounded to
    bf16, and the optimizer's states are float32."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 32).bfloat16())
    ref = torch.nn.Parameter(w.detach().float().clone())
    cfg = load_config(None, ["train.lr=1e-2", "train.weight_decay=0.1"]).train
    opt = build_optimizer([w], cfg)
    assert isinstance(opt, MasterWeightsOptimizer)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(3):
        g = torch.randn(64, 32)
        w.grad, ref.grad = g.bfloat16(), g.bfloat16().float()  # the same (bf16) gradient
        opt.step(), ref_opt.step()
        opt.zero_grad()
    assert torch.equal(opt.masters[0], ref.detach())
    assert torch.equal(w.detach(), ref.detach().bfloat16())
    assert all(v.dtype == torch.float32 for v in opt.state[opt.masters[0]].values() if v.ndim)
    assert w.grad is None


def test_float32_weights_take_a_plain_optimizer_unless_offloaded():
    w = torch.nn.Parameter(torch.randn(4, 4))
    cfg = load_config(None, []).train
    assert isinstance(build_optimizer([w], cfg), torch.optim.AdamW)
    off = load_config(None, ["train.offload=true"]).train
    opt = build_optimizer([w], off)
    assert isinstance(opt, MasterWeightsOptimizer) and opt.masters[0].device.type == "cpu"
    assert opt.masters[0].data_ptr() != w.data_ptr()  # a copy: the states and the step live with it


def test_adamw_8bit_first_step_is_adams_sign_step_with_8bit_states():
    """bitsandbytes' AdamW8bit on a tensor large enough for 8-bit states (>= 4096 entries): its states are
    uint8 and its first step is Adam's first step, lr x g / (|g| + eps) ~ lr x sign(g) (bias-corrected moments
    of one gradient), and the weight decay lr x wd x w before it (AdamW), within 8-bit quantisation error."""
    torch.manual_seed(0)
    w0 = torch.randn(128, 64)
    w = torch.nn.Parameter(w0.clone())
    cfg = load_config(None, ["train.optimizer=adamw_8bit", "train.lr=1e-2", "train.weight_decay=0.1"]).train
    opt = build_optimizer([w], cfg)
    g = torch.randn(128, 64)
    w.grad = g.clone()
    opt.step()
    hand = w0 * (1 - 1e-2 * 0.1) - 1e-2 * g / (g.abs() + 1e-8)
    err = (w.detach() - hand).abs()
    assert err.max().item() <= 0.05 * 1e-2, err.max().item()  # the step is 1e-2; 5% of it
    assert {v.dtype for v in opt.state[w].values() if torch.is_tensor(v) and v.ndim == 2} == {torch.uint8}


def test_adamw_8bit_trains_checkpoints_and_resumes(tmp_path):
    """Full fine-tuning of the tiny SD3 with the 8-bit AdamW: the weights move, the 8-bit states survive a
    checkpoint (safetensors), and a resume continues from them."""
    base = ["lora.enabled=false", "train.optimizer=adamw_8bit", "train.lr=1e-4", "checkpoint.every=1"]
    tr = Trainer(tiny_cfg(tmp_path, *base, "train.epochs=1"))
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    tr.fit()
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in tr.named_params.items())
    assert moved > 0
    eight_bit = [
        v for st in tr.opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dtype == torch.uint8
    ]
    assert eight_bit, "no parameter got 8-bit states"
    again = Trainer(tiny_cfg(tmp_path, *base, "train.epochs=2", "checkpoint.resume=auto"))
    from flowrl.run.checkpoint import resolve_resume

    again.load(*resolve_resume("auto", tmp_path))
    for k, st in tr.opt.state_dict()["state"].items():
        for key, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(again.opt.state_dict()["state"][k][key].cpu(), v.cpu()), (k, key)


def test_adamw_8bit_refuses_fsdp_with_the_fix():
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="adamw_8bit.*sharding"):
        load_config(None, ["train.optimizer=adamw_8bit", "train.sharding=fsdp"])


# ----------------------------------------------------------------------------- offload


def test_modules_in_finds_a_rewards_networks():
    net, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)

    class R:
        def __init__(self):
            self.parts = {"net": net, "more": [head, net]}
            self.name = "r"

    def closure(images, prompts):
        return head(images)

    assert modules_in(R()) == [net, head]
    assert modules_in(closure) == [head]
    assert modules_in(lambda x: x) == []


def test_offload_moves_encoders_vae_and_rewards_only_while_they_run(tmp_path, monkeypatch):
    """With train.offload the text encoders, the VAE and the reward's network are parked (moved to the CPU)
    at start; each visits the compute device only around its own work: the encoders around the prompt
    encoding, the VAE around the decode, the reward's network around its scoring, and they are parked again
    after. The denoiser is never parked."""
    plugin = tmp_path / "netreward.py"
    plugin.write_text(PLUGIN)
    events: list[tuple] = []
    real_to = torch.nn.Module.to

    def spy_to(self, *args, **kwargs):
        events.append(("to", id(self), str(torch.device(args[0])) if args else str(kwargs.get("device"))))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    tr = Trainer(
        tiny_cfg(
            tmp_path / "run",
            "train.offload=true",
            "train.epochs=1",
            f"rewards.0.name={plugin}:scorer",
            "train.ema_decay=0.5",
        )
    )
    backend = tr.policy.backend
    pipe = backend.pipe
    encoders = [m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module) and "text_encoder" in n]
    assert encoders and tr.scorer.parked[0] is not None
    net = tr.scorer.parked[0].modules[0]
    assert isinstance(net, torch.nn.Linear)
    assert {id(m) for m in backend._parked_text.modules} == {id(m) for m in encoders}
    assert [id(m) for m in backend._parked_vae.modules] == [id(pipe.vae)]
    for parked in (backend._parked_text, backend._parked_vae, tr.scorer.parked[0]):  # parked at start
        assert all(str(t.device) == "cpu" for m in parked.modules for t in m.parameters())
        assert parked.device == torch.device("cpu")  # where they compute (this machine's only device)

    def marked(obj, name):
        real = getattr(obj, name)

        def wrapped(*a, **k):
            events.append(("call", name))
            out = real(*a, **k)
            events.append(("done", name))
            return out

        monkeypatch.setattr(obj, name, wrapped)

    marked(backend, "_encode_text"), marked(backend, "decode")
    events.clear()
    batch = tr.rollout(epoch=0)
    tr.score(batch)

    def moves_of(modules):
        ids = {id(m) for m in modules}
        return [i for i, e in enumerate(events) if e[0] == "to" and e[1] in ids]

    def spans(name):
        return [(i, events.index(("done", name), i)) for i, e in enumerate(events) if e == ("call", name)]

    for modules, name in ((encoders, "_encode_text"), ([pipe.vae], "decode")):
        moved = moves_of(modules)
        for start, end in spans(name):  # each call: every module brought before it, parked right after it
            before = [i for i in moved if i < start]
            after = [i for i in moved if i > end]
            assert len(before) >= len(modules) and len(after) >= len(modules), name
            assert all(events[i][2] == "cpu" for i in after[: len(modules)])
    assert spans("_encode_text") and spans("decode")
    net_moves = moves_of([net])
    assert len(net_moves) == 2 and net_moves[0] > spans("decode")[-1][1]  # to its device to score, then parked
    assert not moves_of([backend.denoiser])


def test_offloaded_run_ends_with_the_weights_of_a_plain_run(tmp_path):
    """Offload changes where things live, not the arithmetic: 2 epochs with train.offload (the optimizer
    stepping float32 masters on the CPU, the EMA there) end with bit-identical weights and EMA."""
    extra = ("train.epochs=2", "train.ema_decay=0.5", "train.grpo.beta=0.05", "train.minibatch_size=4")
    plain = Trainer(tiny_cfg(tmp_path / "plain", *extra))
    off = Trainer(tiny_cfg(tmp_path / "off", *extra, "train.offload=true"))
    assert isinstance(off.opt, MasterWeightsOptimizer)
    plain.fit(), off.fit()
    for n, p in plain.named_params.items():
        assert torch.equal(p.detach(), off.named_params[n].detach()), n
        assert torch.equal(plain.ema.shadow[n], off.ema.shadow[n]), n
    assert all(v.device.type == "cpu" for v in off.ema.shadow.values())
    assert off.state.optimizer_steps == plain.state.optimizer_steps > 0


def test_parked_modules_return_to_the_cpu_after_an_error():
    net = torch.nn.Linear(2, 2)
    parked = Parked([net], device="cpu")
    with pytest.raises(RuntimeError):
        with parked.visit():
            raise RuntimeError("the reward failed")
    assert next(net.parameters()).device.type == "cpu"
    assert math.isfinite(net.weight.sum().item())


def test_adamw_8bit_without_bitsandbytes_says_how_to_install_it_before_the_model_loads(tmp_path, monkeypatch):
    import builtins

    from flowrl.errors import FlowrlError
    from flowrl.preflight import preflight

    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name.startswith("bitsandbytes"):
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    monkeypatch.delitem(__import__("sys").modules, "bitsandbytes", raising=False)
    with pytest.raises(FlowrlError, match=r"pip install 'flowrl\[bnb\]'.*train.optimizer=adamw"):
        preflight(tiny_cfg(tmp_path, "train.optimizer=adamw_8bit"))
