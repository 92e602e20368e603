"""The same guarantees for every registered image family (a new family gets them by being registered in
flowrl.families, not by copying tests), on its tiny random-weight pipeline:
- ratio 1: recomputed log-probs of a recorded rollout equal the recorded ones;
- with the SDE off, the rollout is the pipeline's own `pipe(...)`, latent by latent;
- the exported LoRA loads with the pipeline's `load_lora_weights` and reproduces the trained model;
- a directory written by diffusers' own `save_pretrained` trains one `flowrl train` epoch that changes the LoRA
  and writes a checkpoint `flowrl sample` loads.
A video family's tiny model samples `tiny_num_frames` frames (`pipe(num_frames=...)`, `sample.num_frames`).
"""

import json

import pytest
import torch

from flowrl.families import family, family_names, load_image_backend, tiny_pipeline

torch.set_num_threads(1)

FAMILIES = family_names()
PROMPTS = ["a red cat", "a blue dog"]
SIZE = 32
TRAIN = ["sample.height=32", "sample.width=32", "sample.num_steps=3", "sample.max_sequence_length=16",
         "sample.prompts_per_epoch=2", "sample.group_size=2", "eval.num_steps=2", "eval.num_prompts=1",
         "log.progress=false", "model.device=cpu", "train.lr=1e-2", "train.clip_low=0.2", "eval.before=false"]


def test_every_family_is_registered_and_declares_itself():
    assert {"sd3", "flux", "sd15"} <= set(FAMILIES)
    for name in FAMILIES:
        cls = family(name)
        assert cls.family == name and cls.pipeline_classes and cls.lora_targets
        assert cls.default_sde_type in cls.sde_types and "ode" in cls.sde_types


def _train(name: str) -> list[str]:
    """TRAIN with the family's tiny frame count."""
    return [*TRAIN, f"sample.num_frames={family(name).tiny_num_frames}"]


@pytest.fixture(scope="module")
def backends():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_image_backend(f"tiny-{name}", max_sequence_length=16)
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_recomputed_log_probs_equal_the_recorded_ones(name, backends):
    backend = backends(name)
    traj = backend.rollout(PROMPTS, 2, num_steps=4, seed=3, height=SIZE, width=SIZE, decode=False,
                           num_frames=backend.tiny_num_frames)
    assert traj.sde_mask.all() and torch.isfinite(traj.log_probs).all()
    lp, _, _ = backend.step_log_prob(traj, traj.train_steps)                          # [B, K]
    assert (lp - traj.log_probs[:, traj.train_steps].to(lp)).abs().max().item() <= 1e-5


def _pipe_latents(backend, latents, num_steps, guidance_scale):
    """Every step's latents of pipe(...) from `latents` [B, S, ...]."""
    captured = []

    def keep(pipe, i, t, tensors):
        captured.append(tensors["latents"].clone())
        return {}

    per_prompt = {"num_videos_per_prompt": 2, "num_frames": backend.tiny_num_frames} if backend.video else \
        {"num_images_per_prompt": 2}
    backend.pipe(prompt=list(PROMPTS), num_inference_steps=num_steps, height=SIZE, **per_prompt,
                 width=SIZE, latents=backend.pipeline_latents(latents.clone(), SIZE, SIZE),
                 callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"],
                 output_type="latent", **backend.pipeline_call_kwargs(guidance_scale))
    return torch.stack(captured, dim=1)


@pytest.mark.parametrize("name,guidance", [(n, g) for n in FAMILIES for g in family(n).parity_guidance])
def test_the_ode_rollout_is_the_pipelines_own_sampling(name, guidance, backends):
    backend = backends(name)
    traj = backend.rollout(PROMPTS, 2, num_steps=4, sde_type="ode", guidance_scale=guidance, seed=5,
                           height=SIZE, width=SIZE, decode=False, num_frames=backend.tiny_num_frames)
    expected = _pipe_latents(backend, traj.latents[:, 0], 4, guidance)
    assert expected.shape == traj.latents[:, 1:].shape
    assert (traj.latents[:, 1:].float() - expected.float()).abs().max().item() <= 1e-5
    assert traj.latents[:, -1].abs().max() > 0.1


@pytest.mark.parametrize("name", FAMILIES)
def test_the_exported_lora_loads_in_the_pipeline_and_reproduces_the_trained_model(name, tmp_path):
    from flowrl.config import load_config
    from flowrl.policies.image import ImagePolicy

    policy = ImagePolicy(load_config(None, [*_train(name), f"model.path=tiny-{name}"]), "cpu")
    with torch.no_grad():  # lora_B starts at zero: perturb it so that the adapter does something
        for n, p in policy.named_trainable_parameters():
            p.add_(0.5 * torch.randn_like(p))
    policy.export(tmp_path / "lora")
    pipe = tiny_pipeline(f"tiny-{name}")
    pipe.load_lora_weights(tmp_path / "lora")
    loaded = load_image_backend(pipe, max_sequence_length=16)
    base = load_image_backend(tiny_pipeline(f"tiny-{name}"), max_sequence_length=16)
    kwargs = dict(num_steps=3, sde_type="ode", seed=1, height=SIZE, width=SIZE, decode=False,
                  num_frames=family(name).tiny_num_frames)
    ours = policy.backend.rollout(PROMPTS, 1, **kwargs).final_latents
    theirs = loaded.rollout(PROMPTS, 1, **kwargs).final_latents
    untrained = base.rollout(PROMPTS, 1, **kwargs).final_latents
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - untrained).abs().max().item() > 1e-3  # the adapter is really in the export


@pytest.mark.parametrize("name", FAMILIES)
def test_a_saved_pipeline_trains_one_epoch_and_flowrl_sample_loads_its_checkpoint(name, tmp_path):
    from flowrl.cli import main
    from flowrl.trainer import Trainer
    from flowrl.config import load_config

    model = tmp_path / "model"
    tiny_pipeline(f"tiny-{name}").save_pretrained(model)  # diffusers' own format, not flowrl's builder
    run = tmp_path / "run"
    tr = Trainer(load_config(None, [*_train(name), f"model.path={model}", "train.epochs=1", f"log.run_dir={run}"]))
    assert tr.policy.family == name
    before = {n: p.detach().clone() for n, p in tr.named_params.items()}
    tr.fit()
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.named_params.items()) > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in rows if "policy/loss" in r)["policy/ratio_first_dev"] <= 1e-5
    out = tmp_path / "samples"
    assert main(["sample", *_train(name), f"model.path={model}", "--checkpoint", str(run / "ckpt-000001"),
                 "--prompt", "a red cat", "--steps", "2", "--out", str(out)]) == 0
    if family(name).video:  # an animation of the tiny model's frames
        from PIL import Image

        with Image.open(out / "000_seed0.webp") as im:
            assert im.n_frames == family(name).tiny_num_frames
        assert list(run.glob("eval-*/000.webp")) and list(run.glob("eval-*.png"))  # animations beside the grid
    else:
        assert (out / "000_seed0.png").exists()
