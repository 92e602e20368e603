"""Image backends: a diffusers text-to-image pipeline run as a stochastic policy.

One interface (ImageBackend, here), one class per family, registered by name in IMAGE_BACKENDS:
    SD3Backend   (image_flow.py) StableDiffusion3Pipeline (SD3 / SD3.5): flow matching, CFG, sde/cps/dance/ode.
    FluxBackend  (image_flow.py) FluxPipeline (FLUX.1): flow matching, guidance embedding (no CFG), packed latents.
    SD15Backend  (image_sd15.py) StableDiffusionPipeline (SD1.5-style UNet, epsilon prediction): DDPO's DDIM step.

    backend = load_image_backend("stabilityai/stable-diffusion-3.5-medium", dtype=torch.bfloat16, device="cuda")
    traj = backend.rollout(prompts, group_size=8, num_steps=10, sde_window=SDEWindow.fixed(0, 4), seed=0)
    log_prob, mean, std = backend.step_log_prob(traj, traj.train_steps)      # with grad

The denoiser is always reached through `backend.denoiser` (the pipeline's `transformer` / `unet`),
never a cached bound method, so a LoRA wrapper put in its place is what runs.

Before any weight is read, `preflight_image_model(path, height=..., width=...)` checks a model from its
configuration files alone (model_index.json, the denoiser's and the VAE's config.json): a pipeline class
some family drives, the family asked for, the image size, `drop_t5`. `load_image_backend` makes all of
them but the size's before it loads.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from torch import Tensor

from flowrl.core.registry import Registry
from flowrl.sampling import (
    DEFAULT_NOISE_LEVEL,
    PromptEncodings,
    SamplerSettings,
    SDEWindow,
    StepOutput,
    Trajectory,
    as_sde_window,
    record_chain,
)
from flowrl.sampling.step import check_reduce

IMAGE_BACKENDS: Registry[type[ImageBackend]] = Registry("image model family")


class ImageModelError(ValueError):
    """A model that cannot be run as asked (unknown pipeline class, wrong family, image size, drop_t5, a
    configuration file missing or not reachable), found before its weights are loaded; the message says
    what would be right."""


class SizeRule(NamedTuple):
    """The image sizes a model makes: each side a multiple of `multiple` pixels (the VAE factor, times the
    patch size for a transformer) and, when the denoiser bounds it, at most `max_side` pixels (`bound`
    says what sets it)."""

    family: str
    multiple: int
    max_side: int | None = None
    bound: str = ""

    def check(self, height: int, width: int) -> None:
        """An ImageModelError naming the limit and the nearest valid sizes if height x width breaks it."""
        sides = (height, width)
        if any(side % self.multiple or side < self.multiple for side in sides):
            raise ImageModelError(
                f"{self.family} needs height and width divisible by {self.multiple}, got {height}x{width}; "
                f"nearest valid: {self._nearest(height, width)}"
            )
        if self.max_side is not None and max(sides) > self.max_side:
            raise ImageModelError(
                f"{self.family}: this model makes images of at most {self.max_side} px a side ({self.bound}), "
                f"got {height}x{width}; nearest valid: {self._nearest(height, width)}"
            )

    def _nearest(self, height: int, width: int) -> str:
        """The valid sizes next to height x width, e.g. "28x32, 32x32"."""
        options = [self._nearest_sides(height), self._nearest_sides(width)]
        return ", ".join(f"{h}x{w}" for h in options[0] for w in options[1])

    def _nearest_sides(self, side: int) -> list[int]:
        """The valid side lengths just below and just above `side` (itself if valid)."""
        m = self.multiple
        below, above = max(side // m * m, m), max(-(-side // m) * m, m)
        if self.max_side is not None:
            below, above = min(below, self.max_side), min(above, self.max_side)
        return sorted({below, above})


class StepLogProb(NamedTuple):
    """log_prob [b] float32, mean [b, ...] float32, std [b, 1, ..., 1] float32 for one step index;
    [b, K], [b, K, ...], [b, K, 1, ...] for K step indices."""

    log_prob: Tensor
    mean: Tensor
    std: Tensor


@dataclass
class Schedule:
    """Per-step schedule values on the model's device, indexed by step (see Trajectory)."""

    timesteps: Tensor  # [S]
    sigmas: Tensor | None = None  # [S+1] flow
    alphas_cumprod: Tensor | None = None  # [S] DDIM
    alphas_cumprod_prev: Tensor | None = None  # [S] DDIM

    @classmethod
    def of(cls, traj: Trajectory, device) -> Schedule:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return cls(move(traj.timesteps), move(traj.sigmas), move(traj.alphas_cumprod), move(traj.alphas_cumprod_prev))


class ImageBackend:
    """A text-to-image pipeline as a policy. Subclasses fill in the family-specific hooks below."""

    family: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]  # diffusers pipeline class names this backend drives
    denoiser_attr: ClassVar[str]  # "transformer" | "unet"
    sde_types: ClassVar[tuple[str, ...]]
    default_sde_type: ClassVar[str]
    default_guidance_scale: ClassVar[float]
    default_max_sequence_length: ClassVar[int | None] = None
    t5_components: ClassVar[tuple[str, ...]] = ()  # a T5 encoder the family runs without (drop_t5)

    def __init__(self, pipe, *, max_sequence_length: int | None = None, prompt_cache_size: int = 1024):
        """pipe: a loaded diffusers pipeline of this family (see `load_image_backend`).
        max_sequence_length: T5 tokens (SD3 default 256, FLUX 512, capped at the tokenizer's length).
        prompt_cache_size: distinct prompts whose encodings are kept (least recently used dropped)."""
        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)
        self.max_sequence_length = max_sequence_length or self._default_sequence_length()
        self.prompt_cache_size = prompt_cache_size
        self._prompt_cache: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self._shared: dict[str, Tensor] | None = None
        self._negative: dict[str, Tensor] | None = None

    # ---- the model -------------------------------------------------------------------------------

    @property
    def denoiser(self) -> torch.nn.Module:
        """The trainable network (pipeline's transformer or unet)."""
        return getattr(self.pipe, self.denoiser_attr)

    @denoiser.setter
    def denoiser(self, module: torch.nn.Module) -> None:
        setattr(self.pipe, self.denoiser_attr, module)

    @property
    def denoiser_config(self):
        """The denoiser's diffusers config, through a DDP-style wrapper (`.module`) if there is one."""
        module = self.denoiser
        return getattr(module, "module", module).config

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.denoiser.parameters()).dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.pipe).__name__}, dtype={self.dtype}, device={self.device})"

    # ---- prompts ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEncodings:
        """Encodings of the distinct prompts among `prompts` (first-appearance order), each computed once
        and kept in an LRU cache across calls; with the unconditional encodings if the family uses CFG."""
        distinct = list(dict.fromkeys(prompts))
        missing = [p for p in distinct if p not in self._prompt_cache]
        if missing:
            per_prompt, shared = self._encode_text(missing)
            if self._shared is None:
                self._shared = shared
            for i, p in enumerate(missing):
                self._prompt_cache[p] = {name: t[i : i + 1].clone() for name, t in per_prompt.items()}
        for p in distinct:
            self._prompt_cache.move_to_end(p)
        rows = [self._prompt_cache[p] for p in distinct]
        per_prompt = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
        while len(self._prompt_cache) > max(self.prompt_cache_size, len(distinct)):
            self._prompt_cache.popitem(last=False)
        if self.uses_cfg_encodings and self._negative is None:
            self._negative, _ = self._encode_text([""])
        negative = self._negative if self.uses_cfg_encodings else None
        return PromptEncodings(distinct, per_prompt, dict(self._shared or {}), negative)

    # ---- sampling --------------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(
        self,
        prompts: Sequence[str] | str,
        group_size: int = 1,
        *,
        num_steps: int = 10,
        guidance_scale: float | None = None,
        noise_level: float | None = None,
        sde_type: str | None = None,
        sde_window: SDEWindow | tuple[int, int] | str | None = None,
        epoch: int = 0,
        same_noise_per_group: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        height: int | None = None,
        width: int | None = None,
        latents: Tensor | None = None,
        record_means: bool = False,
        decode: bool = True,
        logprob_reduce: str = "mean",
        deterministic_context: Callable[[], AbstractContextManager] | None = None,
    ) -> Trajectory:
        """Sample `group_size` images per prompt and record every step (under no_grad).

        prompts: P prompts; the B = P x group_size samples are prompt-major ([p0, p0, ..., p1, ...]).
        num_steps: S denoising steps.
        guidance_scale: CFG scale (SD3, SD1.5: one batched forward over [uncond, cond] when > 1) or the
            embedded guidance (FLUX). Default: the family's (SD3 4.5, FLUX 3.5, SD1.5 5.0).
        noise_level: the kernel's noise knob (Flow-GRPO's a, CPS's angle fraction, Dance's / DDIM's eta);
            default DEFAULT_NOISE_LEVEL[sde_type] (DDIM: 1.0).
        sde_type: "sde" | "cps" | "dance" | "ode" (flow families), "ddim" | "ode" (SD1.5).
        sde_window: which steps are stochastic (SDEWindow, (start, size) or None = all) at `epoch`;
            the other steps are deterministic and not trained.
        same_noise_per_group: one initial noise per prompt, shared by its group (the per-step noise
            stays independent per sample).
        seed / generator: the RNG for the initial and per-step noise (one of the two, or neither). A seed
            makes a CPU generator (initial noise as diffusers draws it); per-step noise is drawn on the
            model's device from a generator seeded by it.
        height, width: image size in pixels (default: the pipeline's).
        latents: [B, ...] initial noise in the denoiser's layout, instead of drawing it.
        record_means: also keep the transition means [B, S, ...] (float32; memory heavy).
        decode: decode the final latents to PIL images (`traj.images`).
        logprob_reduce: "mean" | "sum" of the per-element log-density.
        deterministic_context: a context the deterministic steps run in (their outputs are neither trained
            nor scored), e.g. the policy's LoRA merged into the weights; the stochastic steps run outside it.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        if group_size < 1 or num_steps < 1:
            raise ValueError(f"group_size and num_steps must be >= 1, got {group_size} and {num_steps}")
        if seed is not None and generator is not None:
            raise ValueError("pass either seed or generator, not both")
        check_reduce(logprob_reduce)
        sde_type = sde_type or self.default_sde_type
        if sde_type not in self.sde_types:
            raise ValueError(f"sde_type {sde_type!r} is not available for {self.family}; valid: {self.sde_types}")
        if noise_level is None:
            noise_level = DEFAULT_NOISE_LEVEL.get(sde_type, 1.0)
        height, width = self.check_image_size(height, width)
        settings = SamplerSettings(
            family=self.family,
            sde_type=sde_type,
            noise_level=float(noise_level),
            guidance_scale=float(self.default_guidance_scale if guidance_scale is None else guidance_scale),
            logprob_reduce=logprob_reduce,
            height=height,
            width=width,
        )
        sde_mask = as_sde_window(sde_window).mask(num_steps, epoch)
        if sde_type == "ode":
            sde_mask[:] = False
        if seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(seed)

        encodings = self.encode_prompts(prompts)
        batch = len(prompts) * group_size
        prompt_ids = encodings.ids_for(prompts).repeat_interleave(group_size)
        group_ids = torch.arange(len(prompts)).repeat_interleave(group_size)
        # with one initial noise per group, a group's rows stay equal until its first stochastic step: the
        # model is evaluated once per group there (the same per-row arithmetic, 1/group_size of the work)
        shared_until = 0
        if latents is None:
            n = len(prompts) if same_noise_per_group else batch
            latents = self._initial_noise(n, settings, generator)
            if same_noise_per_group:
                latents = latents.repeat_interleave(group_size, dim=0)
                stochastic = sde_mask.nonzero()
                shared_until = int(stochastic[0]) + 1 if len(stochastic) else num_steps
            if group_size == 1:
                shared_until = 0
        else:
            expected = (batch, *self._latent_shape(settings))
            if tuple(latents.shape) != expected:
                raise ValueError(
                    f"latents must have shape {expected} (B = prompts x group_size), got {tuple(latents.shape)}"
                )
            latents = latents.to(device=self.device, dtype=self.dtype)
        step_generator = generator
        if generator is not None and generator.device != self.device:
            # Per-step noise is drawn where the latents live (no host-to-device copy per step), from a
            # generator seeded by `generator`: still one seed -> one rollout.
            seed_for_steps = int(torch.randint(0, 2**62, (1,), generator=generator))
            step_generator = torch.Generator(device=self.device).manual_seed(seed_for_steps)
        schedule = self._schedule(num_steps, settings)
        cond = self._condition(encodings, prompt_ids)
        cond_per_group = self._condition(encodings, prompt_ids[::group_size]) if shared_until else None

        stochastic_steps = sde_mask.tolist()

        def denoise(x: Tensor, i: int) -> Tensor:
            if deterministic_context is not None and not stochastic_steps[i]:
                with deterministic_context():
                    return predict(x, i)
            return predict(x, i)

        def predict(x: Tensor, i: int) -> Tensor:
            if i < shared_until:  # steps up to and including the first stochastic one see equal rows per group
                steps = torch.full((len(prompts),), i, dtype=torch.long, device=self.device)
                out = self._predict(x[::group_size], schedule.timesteps[steps], cond_per_group, encodings, settings)
                return out.repeat_interleave(group_size, dim=0)
            steps = torch.full((batch,), i, dtype=torch.long, device=self.device)
            return self._predict(x, schedule.timesteps[steps], cond, encodings, settings)

        def step(model_output: Tensor, x: Tensor, i: int, stochastic: bool) -> StepOutput:
            steps = torch.full((batch,), i, dtype=torch.long, device=self.device)
            return self._step(
                model_output, x, steps, schedule, settings, stochastic=stochastic, generator=step_generator
            )

        chain = record_chain(denoise, step, latents, sde_mask.to(self.device), record_means=record_means)
        traj = Trajectory(
            latents=chain.latents,
            log_probs=chain.log_probs,
            stds=chain.stds,
            timesteps=schedule.timesteps,
            sde_mask=sde_mask.to(self.device),
            prompts=[p for p in prompts for _ in range(group_size)],
            prompt_ids=prompt_ids.to(self.device),
            group_ids=group_ids.to(self.device),
            prompt_encodings=encodings,
            sampler=settings,
            sigmas=schedule.sigmas,
            alphas_cumprod=schedule.alphas_cumprod,
            alphas_cumprod_prev=schedule.alphas_cumprod_prev,
            means=chain.means,
        )
        if decode:
            traj.images = self.decode(traj.final_latents, height=settings.height, width=settings.width)
        return traj

    def step_log_prob(
        self,
        traj: Trajectory,
        step_indices: int | Sequence[int],
        *,
        sample_indices: Sequence[int] | Tensor | None = None,
    ) -> StepLogProb:
        """Re-run the denoiser on recorded latents and score the recorded transitions, WITH grad.

        step_indices: one step index, or K of them evaluated in one model call (the K steps are stacked
            along the batch; results equal one call per step). Each must be a stochastic step.
        sample_indices: the b samples to evaluate (default all B).
        Returns StepLogProb(log_prob, mean, std): [b], [b, ...], [b, 1, ...] for an int step index;
        [b, K], [b, K, ...], [b, K, 1, ...] for a sequence. On the policy that recorded `traj` the
        log-probs equal traj.log_probs (ratio 1).
        """
        if traj.sampler.family != self.family:
            raise ValueError(f"this trajectory was recorded by a {traj.sampler.family} backend, not {self.family}")
        single = isinstance(step_indices, (int, np.integer)) or (
            isinstance(step_indices, Tensor) and step_indices.ndim == 0
        )
        steps = [int(step_indices)] if single else [int(s) for s in step_indices]
        if not steps:
            raise ValueError("step_indices is empty")
        mask = traj.sde_mask.tolist()
        for s in steps:
            if not 0 <= s < traj.num_steps:
                raise IndexError(f"step index {s} out of range for a trajectory of {traj.num_steps} steps")
            if not mask[s]:
                raise ValueError(
                    f"step {s} was deterministic (outside the SDE window): it has no log-prob to train. "
                    f"Stochastic steps: {traj.train_steps}"
                )
        store = traj.latents.device
        rows = torch.arange(len(traj)) if sample_indices is None else torch.as_tensor(sample_indices, dtype=torch.long)
        n_rows, n_steps = len(rows), len(steps)
        rows_k = rows.repeat(n_steps).to(store)  # [K*b], step-major: (step 0: rows), (step 1: rows), ...
        steps_k = torch.tensor(steps, dtype=torch.long).repeat_interleave(n_rows).to(store)
        x = traj.latents[rows_k, steps_k].to(self.device)
        x_prev = traj.latents[rows_k, steps_k + 1].to(self.device)
        schedule = Schedule.of(traj, self.device)
        encodings = traj.prompt_encodings
        cond = self._condition(encodings, traj.prompt_ids[rows_k.to(traj.prompt_ids.device)])
        steps_dev = steps_k.to(self.device)
        model_output = self._predict(x, schedule.timesteps[steps_dev], cond, encodings, traj.sampler)
        out = self._step(model_output, x, steps_dev, schedule, traj.sampler, stochastic=True, prev_latents=x_prev)

        def per_sample(t: Tensor) -> Tensor:  # [K*b, ...] -> [b, K, ...] (or [b, ...] for one step)
            t = t.reshape(n_steps, n_rows, *t.shape[1:]).transpose(0, 1)
            return t[:, 0] if single else t

        return StepLogProb(per_sample(out.log_prob), per_sample(out.mean), per_sample(out.std))

    @torch.no_grad()
    def decode(self, latents: Tensor, *, height: int | None = None, width: int | None = None) -> list:
        """[B, ...] final latents (denoiser layout) -> B PIL images."""
        vae = self.pipe.vae
        image = vae.decode(self._to_vae_latents(latents, height, width).to(vae.device, vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")

    # ---- shared helpers --------------------------------------------------------------------------

    def _condition(self, encodings: PromptEncodings, prompt_ids: Tensor) -> dict[str, Tensor]:
        cond = encodings.gather(prompt_ids)
        return {name: t.to(self.device) for name, t in cond.items()}

    def _negative_like(self, encodings: PromptEncodings, n: int) -> dict[str, Tensor]:
        return {name: t.to(self.device) for name, t in encodings.negative_rows(n).items()}

    def check_image_size(self, height: int | None = None, width: int | None = None) -> tuple[int, int]:
        """(height, width) in pixels, the pipeline's default for None; an ImageModelError if the model
        cannot make that size (see `size_rule`)."""
        default = self._default_image_size()
        height, width = height or default, width or default
        self.size_rule(self.denoiser_config, self.pipe.vae_scale_factor).check(height, width)
        return height, width

    def _default_sequence_length(self) -> int | None:
        if self.default_max_sequence_length is None:
            return None
        t5_tokenizer = getattr(self.pipe, self._t5_tokenizer_attr, None)
        limit = getattr(t5_tokenizer, "model_max_length", None) or self.default_max_sequence_length
        return min(self.default_max_sequence_length, limit)

    # ---- family hooks ----------------------------------------------------------------------------

    uses_cfg_encodings: ClassVar[bool] = False
    _t5_tokenizer_attr: ClassVar[str] = ""

    def _encode_text(self, prompts: list[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """-> (per-prompt tensors [P, ...], shared tensors)."""
        raise NotImplementedError

    def _default_image_size(self) -> int:
        raise NotImplementedError

    @classmethod
    def size_rule(cls, denoiser_config: Mapping, vae_scale_factor: int) -> SizeRule:
        """The sizes a model of this family makes, from its denoiser's config (the saved config.json or
        the loaded model's) and its VAE's downsampling factor: no weights needed."""
        raise NotImplementedError

    def _latent_shape(self, settings: SamplerSettings) -> tuple[int, ...]:
        raise NotImplementedError

    def _initial_noise(self, n: int, settings: SamplerSettings, generator) -> Tensor:
        shape = (n, *self._latent_shape(settings))
        device = generator.device if generator is not None else self.device
        noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        return noise.to(device=self.device, dtype=self.dtype)

    def _schedule(self, num_steps: int, settings: SamplerSettings) -> Schedule:
        raise NotImplementedError

    def _predict(
        self, x: Tensor, t: Tensor, cond: dict, encodings: PromptEncodings, settings: SamplerSettings
    ) -> Tensor:
        """Model output for latents x [N, ...] at denoiser timesteps t [N] (CFG applied)."""
        raise NotImplementedError

    def _step(self, model_output, x, steps, schedule, settings, *, stochastic, prev_latents=None, generator=None):
        raise NotImplementedError

    def _to_vae_latents(self, latents: Tensor, height: int | None, width: int | None) -> Tensor:
        raise NotImplementedError


def _load_families() -> None:
    # The family classes register themselves in IMAGE_BACKENDS when their modules are imported.
    from flowrl.backends import image_flow, image_sd15  # noqa: F401


def _supported_pipelines() -> str:
    """The pipeline classes the families drive, with their families ("StableDiffusion3Pipeline (sd3), ..."),
    for error messages."""
    _load_families()
    return ", ".join(f"{c} ({n})" for n in IMAGE_BACKENDS for c in IMAGE_BACKENDS.get(n).pipeline_classes)


def _family_of_class(cls_or_name: type | str) -> str | None:
    """The family driving a pipeline class (or a subclass of one), or a pipeline class name; None if no
    family does."""
    _load_families()
    by_name = {c: n for n in IMAGE_BACKENDS for c in IMAGE_BACKENDS.get(n).pipeline_classes}
    names = [cls_or_name] if isinstance(cls_or_name, str) else [c.__name__ for c in cls_or_name.__mro__]
    return next((by_name[name] for name in names if name in by_name), None)


def detect_family(pipe) -> str:
    """The backend family of a pipeline, from its class (or a base class)."""
    family = _family_of_class(type(pipe))
    if family is None:
        raise ImageModelError(
            f"no image backend drives {type(pipe).__name__}; supported pipelines: {_supported_pipelines()}"
        )
    return family


# ---- before loading: the model's configuration files only ----------------------------------------------


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _read_local_json(directory: str, name: str) -> dict:
    """The JSON file `name` (e.g. "vae/config.json") of a local pipeline directory."""
    file = os.path.join(directory, *name.split("/"))
    if not os.path.isfile(file):
        raise ImageModelError(
            f"{directory} has no {name}: not a diffusers pipeline directory (write one with pipe.save_pretrained(DIR))"
        )
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _read_hub_json(repo_id: str, name: str, **hub_kwargs) -> dict:
    """The JSON file `name` of a hub model, from the huggingface_hub cache or downloaded (never with
    HF_HUB_OFFLINE set: then a file not cached fails at once)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = _hub_offline()
    subfolder, filename = posixpath.split(name)
    hub_kwargs["local_files_only"] = hub_kwargs.get("local_files_only", False) or offline
    try:
        file = hf_hub_download(repo_id, filename, subfolder=subfolder or None, **hub_kwargs)
    except HFValidationError:
        raise ImageModelError(
            f"{repo_id!r} is neither a local directory nor a hub id (ORG/NAME), nor one of the tiny test models"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else "the hub could not be reached"
        raise ImageModelError(
            f"hub model {repo_id}: {name} is not in the Hugging Face cache and {why}; download the model once "
            f"online (without HF_HUB_OFFLINE) or pass a local directory (pipe.save_pretrained(DIR))"
        ) from None
    except (RepositoryNotFoundError, EntryNotFoundError) as e:
        raise ImageModelError(
            f"hub model {repo_id} has no {name} ({type(e).__name__}): not a diffusers pipeline repository"
        ) from None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _config_reader(path: str, **hub_kwargs) -> Callable[[str], dict]:
    """A reader of the model's JSON configuration files by their path inside it ("model_index.json",
    "transformer/config.json"): from a tiny model's known configs, a local directory, or the hub.
    hub_kwargs: revision, cache_dir, token, local_files_only (hub ids only)."""
    from flowrl.backends.tiny import TINY_PIPELINES, tiny_config_files

    if path in TINY_PIPELINES and not os.path.exists(path):
        files = tiny_config_files(path)
        return lambda name: files[name]
    if os.path.isdir(path):
        return lambda name: _read_local_json(path, name)
    if os.path.exists(path):
        raise ImageModelError(f"{path} is a file; a model is a diffusers pipeline directory or a hub id (ORG/NAME)")
    return lambda name: _read_hub_json(path, name, **hub_kwargs)


def _class_name(model_index: Mapping) -> str:
    """The pipeline class model_index.json names (a custom pipeline's [module, class] gives its class)."""
    name = model_index.get("_class_name")
    return name[-1] if isinstance(name, (list, tuple)) else str(name)


def _null_components(model_index: Mapping) -> list[str]:
    """The components model_index.json records as absent ([null, null]: saved as None)."""
    return [
        name
        for name, value in model_index.items()
        if not name.startswith("_") and (value is None or (isinstance(value, (list, tuple)) and value[0] is None))
    ]


def _vae_scale_factor(read: Callable[[str], dict], model_index: Mapping) -> int:
    """The VAE's downsampling factor as the pipelines compute it (8 without a VAE)."""
    if "vae" not in model_index or "vae" in _null_components(model_index):
        return 8
    return 2 ** (len(read("vae/config.json")["block_out_channels"]) - 1)


def _checked_backend(source: str, model_index: Mapping, family: str, drop_t5: bool) -> type[ImageBackend]:
    """The backend class for a model_index.json: an ImageModelError if no family drives its pipeline
    class, if `family` (unless "auto") is another one, or if drop_t5 is asked of a family with no
    optional T5."""
    _load_families()
    class_name = _class_name(model_index)
    detected = _family_of_class(class_name)
    if detected is None:
        raise ImageModelError(
            f"{source}: no image backend drives {class_name} (model_index.json's _class_name); "
            f"supported pipelines: {_supported_pipelines()}"
        )
    if family != "auto":
        IMAGE_BACKENDS.get(family)  # an unknown name: the error lists the valid ones
        if family != detected:
            raise ImageModelError(
                f"{source} is a {class_name}, a {detected!r} model, not {family!r}: pass family={detected!r} or 'auto'"
            )
    backend_cls = IMAGE_BACKENDS.get(detected)
    if drop_t5:
        _check_drop_t5(backend_cls, source)
    return backend_cls


def _check_drop_t5(backend_cls: type[ImageBackend], source: str) -> None:
    """An ImageModelError if the family cannot run without its T5 encoder."""
    if not backend_cls.t5_components:
        can = [n for n in IMAGE_BACKENDS if IMAGE_BACKENDS.get(n).t5_components]
        raise ImageModelError(
            f"drop_t5 is SD3-only (families with an optional T5: {can}); {source} is a {backend_cls.family!r} model"
        )


def preflight_image_model(path: str, family: str = "auto", *, height: int, width: int, drop_t5: bool = False) -> str:
    """Check that the model at `path` can be run as asked, from its configuration files alone (never its
    weights), and return its family.

    path: a local pipeline directory (its model_index.json, the denoiser's config.json and the VAE's),
        a hub id (the same files from the huggingface_hub cache, or downloaded unless HF_HUB_OFFLINE is
        set), or a tiny test model name ("tiny-sd3", ...).
    family: "auto" or the family the caller expects ("sd3", "flux", "sd15").
    height, width: the image size in pixels the run will ask for.
    drop_t5: the run will leave the T5 encoder out (SD3 only).
    Raises ImageModelError (a ValueError) naming what is wrong and what would be right: a pipeline class
    no family drives (with the supported ones), another family than `family`, a size the model cannot
    make (with the nearest valid ones), drop_t5 for a family without an optional T5, a missing file.
    """
    path = os.fspath(path)
    read = _config_reader(path)
    model_index = read("model_index.json")
    backend_cls = _checked_backend(path, model_index, family, drop_t5)
    denoiser_config = read(f"{backend_cls.denoiser_attr}/config.json")
    backend_cls.size_rule(denoiser_config, _vae_scale_factor(read, model_index)).check(height, width)
    return backend_cls.family


# ---- loading -----------------------------------------------------------------------------------------------

_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only")


def _without(pipe, components: Sequence[str]):
    """A new pipeline of pipe's class sharing its modules, with `components` set to None."""
    return type(pipe)(**{**pipe.components, **{name: None for name in components}})


def _load_pipeline(path: str, family: str, dtype, drop_t5: bool, from_pretrained_kwargs: dict):
    """A pipeline from a tiny model name, a local directory or a hub id, its configuration checked first
    (see preflight_image_model) so that a model no family drives fails before any weight is read."""
    from flowrl.backends.tiny import TINY_PIPELINES

    hub_kwargs = {k: from_pretrained_kwargs[k] for k in _HUB_KWARGS if k in from_pretrained_kwargs}
    model_index = _config_reader(path, **hub_kwargs)("model_index.json")
    backend_cls = _checked_backend(path, model_index, family, drop_t5)
    if path in TINY_PIPELINES and not os.path.exists(path):
        build = TINY_PIPELINES[path]
        return build(drop_t5=True) if drop_t5 else build()
    from diffusers import DiffusionPipeline
    from diffusers.pipelines import pipeline_utils

    # diffusers renamed `torch_dtype` to `dtype` (and deprecated the old name) in late 0.3x
    dtype_kwarg = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    kwargs = {dtype_kwarg: dtype or torch.float32}
    # a component saved as None ([null, null], e.g. an SD3 saved without T5) must be passed as None again
    kwargs.update({name: None for name in _null_components(model_index)})
    if drop_t5:  # never read the T5 weights
        kwargs.update({name: None for name in backend_cls.t5_components})
    return DiffusionPipeline.from_pretrained(path, **{**kwargs, **from_pretrained_kwargs})


def load_image_backend(
    path_or_pipe,
    family: str = "auto",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_sequence_length: int | None = None,
    prompt_cache_size: int = 1024,
    drop_t5: bool = False,
    **from_pretrained_kwargs,
) -> ImageBackend:
    """An ImageBackend for a pipeline object, a hub id, a local directory, or a tiny test pipeline
    ("tiny-sd3", "tiny-flux", "tiny-sd15", random weights, see flowrl.backends.tiny).

    family: "auto" (from the pipeline class), "sd3", "flux" or "sd15".
    dtype, device: where the whole pipeline goes (weights of a path are loaded in `dtype`).
    drop_t5: SD3 only: leave the T5 encoder out (never loaded); prompts are encoded by the CLIP encoders
        and T5's part of the embedding is zeros, as diffusers does for a pipeline saved without T5 (which
        loads without drop_t5 too).
    A path is checked from its configuration files before any weight is loaded (a pipeline class no
    family drives, another family than `family`, drop_t5: an ImageModelError naming the fix).
    Hub loads honour HF_HUB_OFFLINE and the usual huggingface_hub cache settings.
    """
    _load_families()
    if isinstance(path_or_pipe, (str, os.PathLike)):
        pipe = _load_pipeline(os.fspath(path_or_pipe), family, dtype, drop_t5, from_pretrained_kwargs)
    else:
        pipe = path_or_pipe
    if family == "auto":
        family = detect_family(pipe)
    backend_cls = IMAGE_BACKENDS.get(family)
    try:
        detected = detect_family(pipe)
    except ValueError:  # a pipeline class we do not know: trust the family we were given
        detected = family
    if detected != family:
        raise ValueError(f"{type(pipe).__name__} is a {detected!r} pipeline, not {family!r}: pass family={detected!r}")
    if drop_t5 and not isinstance(path_or_pipe, (str, os.PathLike)):
        _check_drop_t5(backend_cls, f"this {type(pipe).__name__}")
        pipe = _without(pipe, backend_cls.t5_components)
    denoiser = getattr(pipe, backend_cls.denoiser_attr)
    current = next(denoiser.parameters())
    moves = device is not None and torch.device(device) != current.device
    if moves or (dtype is not None and dtype != current.dtype):
        pipe.to(device=device, dtype=dtype)
    return backend_cls(pipe, max_sequence_length=max_sequence_length, prompt_cache_size=prompt_cache_size)
