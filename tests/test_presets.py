"""Every preset loads, and one whose model is a hub id fails at once offline, before anything loads, naming the id
and HF_HUB_OFFLINE (not after ~60 s of retries, not with a traceback)."""

from pathlib import Path

import pytest
import yaml

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


def model_path(preset: Path) -> str:
    return (yaml.safe_load(preset.read_text()).get("model") or {}).get("path", "")


HUB_PRESETS = [p for p in PRESETS if "/" in model_path(p) and not (ROOT / model_path(p)).exists()]


def test_the_hub_presets_are_found():
    names = {p.stem for p in HUB_PRESETS}
    assert {"sd35m_pickscore", "flux_dev_pickscore", "sd15_aesthetic", "text_qwen_gsm8k"} <= names


@pytest.mark.parametrize("preset", HUB_PRESETS, ids=lambda p: p.stem)
def test_a_hub_preset_fails_at_once_offline_naming_the_model(preset, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    import flowrl.policies

    monkeypatch.chdir(ROOT)  # the presets' prompt files are relative to the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def refuse(*a, **k):
        raise AssertionError("the model was loaded: the offline check must come first")

    monkeypatch.setattr(flowrl.policies, "build_policy", refuse)
    model = model_path(preset)
    local_data = []  # the text presets' dataset would fail first (at once too): give them local prompts
    if "backend: text" in preset.read_text():
        local_data = [
            "data.train_prompts=samples/arith/train.jsonl",
            "data.eval_prompts=samples/arith/test.jsonl",
            "data.prompt_column=prompt",
            "data.prompt_template='{prompt}'",
        ]
    rc = main(["train", str(preset), f"log.run_dir={tmp_path / 'run'}", *local_data])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert model in err and "HF_HUB_OFFLINE" in err, err


def test_the_accelerate_configs_are_valid_accelerate_configs():
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
    assert {f.stem for f in files} >= {
        "ddp_8gpu",
        "multinode_2x8gpu",
        "cpu_2proc",
        "fsdp_8gpu",
        "deepspeed_zero2",
        "deepspeed_zero3",
    }
    for f in files:
        cfg = load_config_from_file(str(f))
        expected = "DEEPSPEED" if f.stem.startswith("deepspeed") else "MULTI_GPU"
        assert cfg.distributed_type.value == expected and cfg.num_processes >= 2, f
        assert f"--config_file configs/accelerate/{f.name}" in f.read_text(), f  # its header shows the launch
        assert cfg.num_processes % cfg.num_machines == 0, f


def test_the_objective_presets_keep_their_papers_recipes():
    """sd35m_{nft,awm,dpo,elbo,crd,dgpo}_pickscore hold the numbers their headers take from DiffusionNFT's, AWM's,
    Diffusion-DPO's, ELBO-likelihood RL's and Flow-Factory's (CRD, DGPO) code, so that a later edit cannot drift
    from them silently."""
    from flowrl.config import load_config
    from flowrl.objectives import get_objective

    def load(name, tokens=128, rank=32, eval_steps=40, minibatch=0, grad_norm=1.0):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        s, t = cfg.sample, cfg.train
        assert (cfg.model.path, s.height, s.width, s.max_sequence_length) == (
            "stabilityai/stable-diffusion-3.5-medium",
            512,
            512,
            tokens,
        ), name
        assert (cfg.lora.enabled, cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (
            True,
            rank,
            2.0 * rank,
            None,
        )
        assert [r.name for r in cfg.rewards] == ["pickscore"]
        assert (cfg.data.train_prompts, cfg.data.eval_prompts) == (
            "samples/prompts/pickscore_train.txt",
            "samples/prompts/pickscore_test.txt",
        )
        assert cfg.log.run_dir == f"runs/{name}" and cfg.eval.num_steps == eval_steps
        assert (t.minibatch_size, t.inner_epochs, t.adam_betas, t.adam_eps, t.max_grad_norm) == (
            minibatch,
            1,
            [0.9, 0.999],
            1e-8,
            grad_norm,
        ), name  # one optimizer step an epoch (minibatch 0: the whole batch) unless the recipe takes more
        return cfg, s, t

    # DiffusionNFT (config/nft.py:sd3_pickscore): CFG-free, 10 steps, 24 x 48, 9 of 10 steps trained
    cfg, s, t = load("sd35m_nft_pickscore")
    n = t.nft
    assert t.objective == "nft"
    assert (s.num_steps, s.guidance_scale, cfg.eval.guidance_scale, s.group_size, s.prompts_per_epoch) == (
        10,
        1.0,
        1.0,
        24,
        48,
    )
    assert (t.lr, t.weight_decay, t.adv_scale, t.adv_clip_max, t.ema_decay, t.micro_batch_size) == (
        3e-4,
        1e-4,
        "batch",
        5.0,
        0.9,
        9,
    )
    assert (n.beta, n.kl_coef, n.adv_clip, n.policy_scale, n.adaptive_weight) == (1.0, 1e-4, 5.0, 5.0, True)
    assert (n.decay_rate, n.decay_cap, n.decay_start) == (1e-3, 0.5, 0)
    assert get_objective("nft").times_per_sample(n, s.num_steps) == 9
    assert (cfg.eval.every, cfg.checkpoint.every) == (10, 30)

    # AWM (config/dgx_awm.py:pickscore_sd3_no_cfg_1node): CFG-free, 14 steps, 24 x 24, 6 times of the first 90%
    cfg, s, t = load("sd35m_awm_pickscore")
    a = t.awm
    assert t.objective == "awm"
    assert (s.num_steps, s.guidance_scale, cfg.eval.guidance_scale, s.group_size, s.prompts_per_epoch) == (
        14,
        1.0,
        1.0,
        24,
        24,
    )
    assert (t.lr, t.weight_decay, t.adv_scale, t.adv_clip_max, t.ema_decay) == (3e-4, 1e-4, "batch", 5.0, 0.99)
    assert (t.micro_batch_size, t.steps_per_forward) == (2, 6)
    assert (a.weighting, a.ghuber_power, a.advantage_clip, a.timesteps, a.timestep_fraction) == (
        "ghuber",
        0.25,
        5.0,
        6,
        0.9,
    )
    assert (a.kl_coef, a.ema_kl_coef, a.ema_decay_rate, a.ema_decay_cap) == (1e-4, 1.0, 1e-3, 0.3)
    assert (cfg.eval.every, cfg.checkpoint.every) == (50, 50)

    # online Diffusion-DPO: the paper's beta on its noise-space loss and its AdamW settings; the LoRA lr of the
    # SD3.5 recipes (the header says why); Flow-GRPO's sampling (CFG 4.5, 10 steps, 24 x 48)
    cfg, s, t = load("sd35m_dpo_pickscore")
    d = t.dpo
    assert t.objective == "dpo"
    assert (d.beta, d.weighting, get_objective("dpo").times_per_sample(d, s.num_steps)) == (5000.0, "noise", 10)
    assert (t.lr, t.weight_decay, t.warmup_steps, t.ema_decay) == (3e-4, 1e-2, 0, 0.0)
    assert (s.num_steps, s.guidance_scale, cfg.eval.guidance_scale, s.group_size, s.prompts_per_epoch) == (
        10,
        4.5,
        4.5,
        24,
        48,
    )

    # ELBO-likelihood RL (scripts/sd3/sd3_geneval_pepg.sh on config/sd3.py): CFG-free, 10 steps, 24 x 48, PEPG on
    # the adaptive ELBO at 9 of 10 steps, KL 1e-4, old policy lagging min(1e-3 x step, 0.5), clip 5, no std
    cfg, s, t = load("sd35m_elbo_pickscore", grad_norm=5.0)
    e = t.elbo
    assert t.objective == "elbo"
    assert (s.num_steps, s.guidance_scale, cfg.eval.guidance_scale, s.group_size, s.prompts_per_epoch) == (
        10,
        1.0,
        1.0,
        24,
        48,
    )
    assert (t.lr, t.weight_decay, t.adv_scale, t.adv_clip_max, t.ema_decay, t.seed, t.epochs) == (
        3e-4,
        1e-4,
        "none",
        5.0,
        0.9,
        96,
        360,
    )
    assert (e.loss, e.weighting, e.kl_coef, e.old_decay_rate, e.old_decay_cap, e.old_decay_start) == (
        "pepg",
        "adaptive",
        1e-4,
        1e-3,
        0.5,
        0,
    )
    assert get_objective("elbo").times_per_sample(e, s.num_steps) == 9
    assert cfg.eval.every == 10

    # CRD (Flow-Factory examples/crd/lora/sd3_5/default.yaml): CFG-free, 10 steps, 24 x 48, two steps an epoch,
    # beta 1 MSE, adaptive KL 0.1 at CFG 4.5, the old and sampling snapshots' decay schedules
    cfg, s, t = load("sd35m_crd_pickscore", tokens=512, minibatch=576)
    c = t.crd
    assert t.objective == "crd"
    assert (s.num_steps, s.guidance_scale, cfg.eval.guidance_scale, s.group_size, s.prompts_per_epoch) == (
        10,
        1.0,
        1.0,
        24,
        48,
    )
    assert s.group_size * s.prompts_per_epoch == 2 * t.minibatch_size  # gradient_step_per_epoch 2
    assert (t.lr, t.weight_decay, t.adv_scale, t.adv_clip_max, t.micro_batch_size) == (3e-4, 1e-4, "batch", 5.0, 24)
    assert (c.beta, c.loss, c.adaptive_weight, c.weight_temp, c.adv_clip) == (1.0, "mse", True, -1.0, 5.0)
    assert (c.kl_beta, c.kl_cfg, c.adaptive_kl) == (0.1, 4.5, True)
    assert (c.old_decay_start, c.old_decay_initial, c.old_decay_rate, c.old_decay_cap) == (0, 0.25, 0.005, 0.999)
    assert (c.sampling_decay_start, c.sampling_decay_initial, c.sampling_decay_rate, c.sampling_decay_cap) == (
        75,
        0.0,
        0.0075,
        0.999,
    )
    assert get_objective("crd").times_per_sample(c, s.num_steps) == 9
    assert (cfg.eval.every, cfg.checkpoint.every) == (20, 20)

    # DGPO (Flow-Factory examples/dgpo/lora/sd3_5/default.yaml, the authors' pickscore_sd3_4gpu): CFG 4.5, 10
    # steps (14 to evaluate), 24 x 24, beta 10, 4 shared times of the noisiest 60%, DSM clip 5e-2, KL 1e-3
    cfg, s, t = load("sd35m_dgpo_pickscore", tokens=512, rank=64, eval_steps=14)
    d = t.dgpo
    assert t.objective == "dgpo"
    assert (s.num_steps, s.guidance_scale, cfg.eval.guidance_scale, s.group_size, s.prompts_per_epoch) == (
        10,
        4.5,
        4.5,
        24,
        24,
    )
    assert (t.lr, t.weight_decay, t.adv_scale, t.ema_decay, t.micro_batch_size) == (3e-4, 1e-4, "batch", 0.9, 24)
    assert (d.beta, d.adv_clip, d.clip_dsm, d.clip_range, d.kl_coef, d.kl_cfg) == (10.0, 5.0, True, 0.05, 1e-3, 1.0)
    assert (d.use_ema_ref, d.ema_decay_rate, d.ema_decay_cap, d.switch_ema_ref, d.shared_noise) == (
        False,
        1e-3,
        0.3,
        200,
        True,
    )
    assert (d.timesteps, d.timestep_fraction) == (4, 0.6)
    assert (cfg.eval.every, cfg.checkpoint.every) == (60, 60)
