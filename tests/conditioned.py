"""Conditioning images for the shared family tests: a family that takes them (`condition_images`, an editor or an
image-to-video model) gets a small generated source image per prompt, the fewest it takes, so that every test runs
it as it is meant to run, without a case per family."""

import json
from pathlib import Path

import numpy as np
from PIL import Image

from flowrl.families import family, family_names


def source_image(size: int = 32, seed: int = 0) -> Image.Image:
    """A size x size RGB image: a colour gradient with a square on it, the same for the same seed."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    pixels = np.stack(
        [
            np.add.outer(ramp, ramp) / 2,
            np.add.outer(ramp, -ramp) / 2 + 128,
            np.full((size, size), float(rng.integers(0, 256))),
        ],
        axis=-1,
    )
    pixels[size // 4 : size // 2, size // 4 : size // 2] = rng.integers(0, 256, 3)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def takes_images(name: str) -> bool:
    """Whether a family takes conditioning images (False for a name that is no family, e.g. a saved variant's)."""
    return name in family_names() and family(name).condition_images[0] > 0


def images_per_prompt(name: str) -> list[Image.Image]:
    """One prompt's conditioning images for a family: the fewest it takes (none for text-to-image)."""
    return [source_image(seed=k) for k in range(family(name).condition_images[0])] if takes_images(name) else []


def condition_images(name: str, num_prompts: int) -> list[list[Image.Image]] | None:
    """`rollout(images=...)` for num_prompts prompts (the same images for each, as `pipe(image=...)` takes one set
    for the whole call), or None for a text-to-image family."""
    return [images_per_prompt(name) for _ in range(num_prompts)] if takes_images(name) else None


def prompt_data(name: str, directory: Path, prompts: list[str]) -> list[str]:
    """The config overrides giving a run these prompts with their conditioning images: a .jsonl with an `image`
    column beside the saved images for a family that takes them, nothing for a text-to-image family."""
    if not takes_images(name):
        return []
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, im in enumerate(images_per_prompt(name)):
        im.save(directory / f"source{k}.png")
        paths.append(f"source{k}.png")
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "image": paths}) + "\n" for p in prompts))
    return [f"data.train_prompts={path}", f"data.eval_prompts={path}"]


def sample_args(name: str, directory: Path) -> list[str]:
    """`flowrl sample` arguments giving its prompts a family's conditioning images (saved in `directory`)."""
    args = []
    directory.mkdir(parents=True, exist_ok=True)
    for k, im in enumerate(images_per_prompt(name)):
        im.save(directory / f"sample_source{k}.png")
        args += ["--image", str(directory / f"sample_source{k}.png")]
    return args


def tiny_rollout(backend, name: str, *, num_steps: int = 4, **kwargs):
    """A rollout of family `name`'s tiny backend as the shared family tests make it: two prompts x 2, 32 px, seed 3,
    latents only, with the family's frames and conditioning images; `kwargs` go to `backend.rollout`."""
    return backend.rollout(
        ["a red cat", "a blue dog"],
        2,
        num_steps=num_steps,
        seed=3,
        height=32,
        width=32,
        decode=False,
        num_frames=backend.tiny_num_frames,
        images=condition_images(name, 2),
        **kwargs,
    )


def pair_data(name: str, directory: Path, prompts: list[str], num_frames: int = 1) -> list[str]:
    """The config overrides giving a run of family `name` offline DPO pairs of these prompts (train.dpo_offline.pairs,
    sample.group_size=2): a .jsonl beside 32 x 32 generated images, chosen and rejected, for an image family, or
    beside `.safetensors` random latents of the tiny model's sample shape for a video family (which takes no
    images); an editing family's rows carry their conditioning images, as `prompt_data`'s."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    video = name in family_names() and family(name).video
    shape = None
    if video:
        from flowrl.families import load_image_backend

        shape = load_image_backend(f"tiny-{name}", dtype=torch.float32, device="cpu").latent_shape(32, 32, num_frames)
    sources = []
    for k, im in enumerate(images_per_prompt(name)):
        im.save(directory / f"source{k}.png")
        sources.append(f"source{k}.png")
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": prompt, "tag": i}
        for j, side in enumerate(("chosen", "rejected")):
            if video:
                gen = torch.Generator().manual_seed(10 * i + j)
                save_file({"latents": torch.randn(shape, generator=gen)}, directory / f"{i}_{side}.safetensors")
                row[side] = f"{i}_{side}.safetensors"
            else:
                source_image(32, seed=100 + 10 * i + j).save(directory / f"{i}_{side}.png")
                row[side] = f"{i}_{side}.png"
        if sources:
            row["image"] = sources
        rows.append(row)
    path = directory / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"train.dpo_offline.pairs={path}", "sample.group_size=2"]
