"""test_families.py's guarantees for the tiny Flux2KleinPipeline (base: CFG; distilled: none)."""

import json

import pytest
import torch
from test_families import PROMPTS, SIZE, TRAIN, _pipe_latents

from flowrl.families import load_image_backend
from flowrl.families.flux2 import tiny_flux2_pipeline

VARIANTS = {"base": dict(klein=True), "distilled": dict(klein=True, distilled=True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    dirs = {}
    for name, opts in VARIANTS.items():
        d = tmp_path_factory.mktemp(name)
        tiny_flux2_pipeline(**opts).save_pretrained(d)
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("variant", VARIANTS)
def test_ratio_one(variant):
    backend = load_image_backend(tiny_flux2_pipeline(**VARIANTS[variant]), max_sequence_length=16)
    traj = backend.rollout(PROMPTS, 2, num_steps=4, seed=3, height=SIZE, width=SIZE, decode=False)
    lp, _, _ = backend.step_log_prob(traj, traj.train_steps)
    assert (lp - traj.log_probs[:, traj.train_steps].to(lp)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant,guidance", [(v, g) for v in VARIANTS for g in (1.0, 4.0)])
def test_ode_parity(variant, guidance):
    backend = load_image_backend(tiny_flux2_pipeline(**VARIANTS[variant]), max_sequence_length=16)
    assert backend.uses_cfg_encodings == (variant == "base")
    traj = backend.rollout(
        PROMPTS, 2, num_steps=4, sde_type="ode", guidance_scale=guidance, seed=5, height=SIZE, width=SIZE, decode=False
    )
    expected = _pipe_latents(backend, traj.latents[:, 0], 4, guidance)
    assert expected.shape == traj.latents[:, 1:].shape
    assert (traj.latents[:, 1:].float() - expected.float()).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_export(variant, saved, tmp_path):
    from flowrl.config import load_config
    from flowrl.policies.image import ImagePolicy

    policy = ImagePolicy(load_config(None, [*TRAIN, f"model.path={saved[variant]}"]), "cpu")
    with torch.no_grad():
        for n, p in policy.named_trainable_parameters():
            p.add_(0.5 * torch.randn_like(p))
    policy.export(tmp_path / "lora")
    pipe = tiny_flux2_pipeline(**VARIANTS[variant])
    pipe.load_lora_weights(tmp_path / "lora")
    loaded = load_image_backend(pipe, max_sequence_length=16)
    base = load_image_backend(tiny_flux2_pipeline(**VARIANTS[variant]), max_sequence_length=16)
    kwargs = dict(num_steps=3, sde_type="ode", seed=1, height=SIZE, width=SIZE, decode=False)
    ours = policy.backend.rollout(PROMPTS, 1, **kwargs).final_latents
    theirs = loaded.rollout(PROMPTS, 1, **kwargs).final_latents
    untrained = base.rollout(PROMPTS, 1, **kwargs).final_latents
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - untrained).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
def test_saved_trains_and_samples(variant, saved, tmp_path):
    from flowrl.cli import main
    from flowrl.config import load_config
    from flowrl.train import Trainer

    model = saved[variant]
    run = tmp_path / "run"
    tr = Trainer(load_config(None, [*TRAIN, f"model.path={model}", "train.epochs=1", f"log.run_dir={run}"]))
    assert tr.policy.family == "flux2" and tr.policy.backend.klein
    assert tr.policy.backend.distilled == (variant == "distilled")
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    tr.fit()
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.named_params.items()) > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in rows if "policy/loss" in r)["policy/ratio_first_dev"] <= 1e-5
    out = tmp_path / "samples"
    assert (
        main(
            [
                "sample",
                *TRAIN,
                f"model.path={model}",
                "--checkpoint",
                str(run / "ckpt-000001"),
                "--prompt",
                "a red cat",
                "--steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "000_seed0.png").exists()
