"""Image model families: each module here (but those starting with "_") is one family, and declares everything
about it in one ImageBackend subclass registered with `@register_family`: the diffusers pipeline classes it
drives, its denoiser attribute and class, the step kernels it allows and its default one, its LoRA target
modules, how its LoRA is exported for the pipeline's `load_lora_weights`, and a tiny random-weight pipeline for
tests (`tiny-<family>`). The families are discovered by importing the modules; nothing else lists them.
Adding a family = adding one module: see docs/new_model.md.

    backend = load_image_backend("stabilityai/stable-diffusion-3.5-medium", dtype=torch.bfloat16, device="cuda")
    traj = backend.rollout(prompts, group_size=8, num_steps=10, sde_window=SDEWindow.fixed(0, 4), seed=0)
    log_prob, mean, std = backend.step_log_prob(traj, traj.train_steps)      # with grad

The denoiser is always reached through `backend.denoiser` (the pipeline's `transformer` / `unet`), never a cached
bound method, so a LoRA wrapper put in its place is what runs. Importing this package imports no family module
and no diffusers; `family_names()` and the loaders discover the families on first use.
"""

from ._base import (
    FAMILIES,
    ImageBackend,
    ImageModelError,
    Schedule,
    SizeRule,
    StepLogProb,
    register_family,
)
from ._loading import (
    UNUSED_COMPONENTS,
    check_components,
    check_model_index,
    checked_backend,
    detect_family,
    family,
    family_names,
    hub_offline,
    load_all,
    load_image_backend,
    preflight_image_model,
    read_hub_json,
    tiny_models,
    tiny_pipeline,
)

__all__ = [
    "FAMILIES",
    "UNUSED_COMPONENTS",
    "ImageBackend",
    "ImageModelError",
    "Schedule",
    "SizeRule",
    "StepLogProb",
    "check_components",
    "check_model_index",
    "checked_backend",
    "detect_family",
    "family",
    "family_names",
    "hub_offline",
    "load_all",
    "load_image_backend",
    "preflight_image_model",
    "read_hub_json",
    "register_family",
    "tiny_models",
    "tiny_pipeline",
]
