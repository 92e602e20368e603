"""The same guarantees for every registered image family (a new family gets them by being registered in
flowrl.families, not by copying tests), on its tiny random-weight pipeline:
- ratio 1: recomputed log-probs of a recorded rollout equal the recorded ones;
- with the SDE off, the rollout is the pipeline's own `pipe(...)`, latent by latent;
- the exported LoRA loads with the pipeline's `load_lora_weights` and reproduces the trained model;
- a directory written by diffusers' own `save_pretrained` trains one `flowrl train` epoch that changes the LoRA
  and writes a checkpoint `flowrl sample` loads;
- a directory saved with another scheduler the family swaps for its own (`other_schedulers`: a plain Euler or
  DPM-Solver config, with none of DDIM's keys; a flow solver) samples finite log-probs with a finite gradient.
A video family's tiny model samples `tiny_num_frames` frames (`pipe(num_frames=...)`, `sample.num_frames`); a family
taking conditioning images (an editor, image-to-video) gets a small generated source image per prompt (`conditioned`).
"""

import json

import pytest
import torch
from conditioned import condition_images, images_per_prompt, prompt_data, sample_args, tiny_rollout

from flowrl.families import family, family_names, load_image_backend, tiny_pipeline

torch.set_num_threads(1)

FAMILIES = family_names()
PROMPTS = ["a red cat", "a blue dog"]
SIZE = 32
TRAIN = [
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=3",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=2",
    "eval.num_steps=2",
    "eval.num_prompts=1",
    "log.progress=false",
    "model.device=cpu",
    "train.lr=1e-2",
    "train.grpo.clip_low=0.2",
    "eval.before=false",
]


def test_every_family_is_registered_and_declares_itself():
    assert {"sd3", "flux", "sd15"} <= set(FAMILIES)
    for name in FAMILIES:
        cls = family(name)
        assert cls.family == name and cls.pipeline_classes and cls.lora_targets
        assert cls.default_sde_type in cls.sde_types and "ode" in cls.sde_types


def _train(name: str) -> list[str]:
    """TRAIN with the family's tiny frame count."""
    return [*TRAIN, f"sample.num_frames={family(name).tiny_num_frames}"]


@pytest.mark.parametrize("name", FAMILIES)
def test_recomputed_log_probs_equal_the_recorded_ones(name, backends):
    backend = backends(name)
    traj = tiny_rollout(backend, name)
    assert traj.sde_mask.all() and torch.isfinite(traj.log_probs).all()
    lp, _, _ = backend.step_log_prob(traj, traj.train_steps)  # [B, K]
    assert (lp - traj.log_probs[:, traj.train_steps].to(lp)).abs().max().item() <= 1e-5


def _pipe_latents(backend, latents, num_steps, guidance_scale):
    """Every step's latents of pipe(...) from `latents` [B, S, ...] (every prompt with the same conditioning images,
    if the family takes them), in the calls the family makes a batch of (`pipeline_batches`)."""
    per_call = []
    start = 0
    for call in backend.pipeline_batches(PROMPTS, 2):
        n = len(call["prompt"]) * call.get("num_images_per_prompt", call.get("num_videos_per_prompt", 1))
        captured = []

        def keep(pipe, i, t, tensors):
            captured.append(tensors["latents"].clone())
            return {}

        frames = {"num_frames": backend.tiny_num_frames} if backend.video else {}
        backend.pipe(
            **call,
            num_inference_steps=num_steps,
            height=SIZE,
            width=SIZE,
            **frames,
            latents=backend.pipeline_latents(latents[start : start + n].clone(), SIZE, SIZE),
            callback_on_step_end=keep,
            callback_on_step_end_tensor_inputs=["latents"],
            output_type="latent",
            **backend.pipeline_call_kwargs(guidance_scale),
            **backend.pipeline_condition_kwargs(images_per_prompt(backend.family), SIZE, SIZE),
        )
        per_call.append(torch.stack(captured, dim=1))
        start += n
    return torch.cat(per_call)


@pytest.mark.parametrize("name,guidance", [(n, g) for n in FAMILIES for g in family(n).parity_guidance])
def test_the_ode_rollout_is_the_pipelines_own_sampling(name, guidance, backends):
    backend = backends(name)
    traj = backend.rollout(
        PROMPTS,
        2,
        num_steps=4,
        sde_type="ode",
        guidance_scale=guidance,
        seed=5,
        height=SIZE,
        width=SIZE,
        decode=False,
        num_frames=backend.tiny_num_frames,
        images=condition_images(name, len(PROMPTS)),
    )
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
    kwargs = dict(
        num_steps=3,
        sde_type="ode",
        seed=1,
        height=SIZE,
        width=SIZE,
        decode=False,
        num_frames=family(name).tiny_num_frames,
        images=condition_images(name, len(PROMPTS)),
    )
    ours = policy.backend.rollout(PROMPTS, 1, **kwargs).final_latents
    theirs = loaded.rollout(PROMPTS, 1, **kwargs).final_latents
    untrained = base.rollout(PROMPTS, 1, **kwargs).final_latents
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - untrained).abs().max().item() > 1e-3  # the adapter is really in the export


@pytest.mark.parametrize("name", FAMILIES)
def test_a_saved_pipeline_trains_one_epoch_and_flowrl_sample_loads_its_checkpoint(name, tmp_path, capsys):
    from flowrl.cli import main
    from flowrl.config import load_config
    from flowrl.train import Trainer

    model = tmp_path / "model"
    tiny_pipeline(f"tiny-{name}").save_pretrained(model)  # diffusers' own format, not flowrl's builder
    run = tmp_path / "run"
    data = prompt_data(name, tmp_path / "data", PROMPTS)
    tr = Trainer(
        load_config(None, [*_train(name), f"model.path={model}", "train.epochs=1", f"log.run_dir={run}", *data])
    )
    assert tr.policy.family == name
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
                *_train(name),
                f"model.path={model}",
                "--checkpoint",
                str(run / "ckpt-000001"),
                "--prompt",
                "a red cat",
                "--steps",
                "2",
                "--out",
                str(out),
                *sample_args(name, tmp_path),
            ]
        )
        == 0
    )
    wrote = "videos" if family(name).video else "images"
    assert f"wrote 1 {wrote} to {out}" in capsys.readouterr().out
    if family(name).video:  # an animation of the tiny model's frames
        from PIL import Image

        with Image.open(out / "000_seed0.webp") as im:
            assert im.n_frames == family(name).tiny_num_frames
        assert list(run.glob("eval-*/000.webp")) and list(run.glob("eval-*.png"))  # animations beside the grid
    else:
        assert (out / "000_seed0.png").exists()


def _plain_scheduler(class_name: str, config, extra: dict):
    """A `class_name` scheduler with the model's noise schedule and only its own config keys (a directory written by
    another tool has no other scheduler's keys, e.g. no DDIM `set_alpha_to_one`)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, class_name)
    own = inspect.signature(cls.__init__).parameters
    return cls.from_config({**{k: v for k, v in config.items() if k in own}, **extra})


OTHER_SCHEDULERS = [(n, cls, extra) for n in FAMILIES for cls, extra in family(n).other_schedulers]


@pytest.mark.parametrize("name,scheduler,extra", OTHER_SCHEDULERS, ids=[f"{n}-{cls}" for n, cls, _ in OTHER_SCHEDULERS])
def test_a_directory_with_another_scheduler_trains_with_finite_log_probs(name, scheduler, extra, tmp_path):
    assert {"sd15", "sdxl", "sana", "wan"} <= {n for n, _, _ in OTHER_SCHEDULERS}
    pipe = tiny_pipeline(f"tiny-{name}")
    pipe.scheduler = _plain_scheduler(scheduler, pipe.scheduler.config, extra)
    pipe.save_pretrained(tmp_path / "model")
    backend = load_image_backend(str(tmp_path / "model"), max_sequence_length=16)
    traj = tiny_rollout(backend, name, num_steps=3)
    assert traj.sde_mask.all() and torch.isfinite(traj.log_probs).all(), traj.log_probs
    backend.denoiser.requires_grad_(True)
    with torch.enable_grad():
        lp, _, _ = backend.step_log_prob(traj, traj.train_steps)
        lp.sum().backward()
    grads = [p.grad for p in backend.denoiser.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


CONDITIONED = [n for n in FAMILIES if family(n).condition_images[1] > 0]


@pytest.mark.parametrize("name", CONDITIONED)
def test_a_conditioned_familys_samples_follow_their_source_image(name, backends):
    """Two prompts with one text and different source images sample differently from one noise; the same source
    samples the same."""
    from conditioned import source_image

    backend = backends(name)
    fewest = family(name).condition_images[0]
    first, second = [source_image(seed=k) for k in range(fewest)], [source_image(seed=10 + k) for k in range(fewest)]
    final = backend.rollout(
        ["make it blue"] * 3,
        1,
        num_steps=2,
        sde_type="ode",
        height=SIZE,
        width=SIZE,
        decode=False,
        num_frames=backend.tiny_num_frames,
        images=[first, second, first],
        latents=_one_noise(backend, 3),
    ).final_latents
    assert (final[0] - final[1]).abs().max() > 1e-4 and (final[0] - final[2]).abs().max() <= 1e-6


def _one_noise(backend, n: int) -> torch.Tensor:
    """One initial noise of a SIZE x SIZE sample, repeated n times: [n, ...]."""
    from flowrl.sampling import SamplerSettings

    settings = SamplerSettings(
        family=backend.family,
        sde_type="ode",
        noise_level=0.0,
        guidance_scale=1.0,
        logprob_reduce="mean",
        height=SIZE,
        width=SIZE,
        num_frames=backend.tiny_num_frames,
    )
    noise = backend._initial_noise(1, settings, torch.Generator().manual_seed(0))
    return noise.repeat(n, *[1] * (noise.ndim - 1))


@pytest.mark.parametrize("name", CONDITIONED)
def test_a_wrong_image_count_in_the_prompt_file_stops_the_run_naming_file_and_line(name, tmp_path, monkeypatch):
    from conditioned import source_image

    from flowrl import families
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, preflight

    monkeypatch.setattr(families, "load_image_backend", lambda *a, **k: pytest.fail("preflight loaded a model"))
    low, high = family(name).condition_images
    for k in range(high + 1):
        source_image(seed=k).save(tmp_path / f"s{k}.png")
    rows = [
        {"prompt": "fine", "image": [f"s{k}.png" for k in range(low)]},
        {"prompt": "too many", "image": [f"s{k}.png" for k in range(high + 1)]},
    ]
    path = tmp_path / "edits.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            f"model.path=tiny-{name}",
            f"data.train_prompts={path}",
            "sample.height=32",
            "sample.width=32",
            f"sample.num_frames={family(name).tiny_num_frames}",
        ],
    )
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "\n" not in message and f"{path}:2: {name} takes" in message and f"got {high + 1}" in message
    path.write_text(json.dumps({"prompt": "no image"}) + "\n")
    with pytest.raises(PreflightError, match=f"{path}:1: {name} takes .* got 0"):
        preflight(cfg)
