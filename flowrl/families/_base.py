"""The interface every image family implements: a diffusers text-to-image pipeline run as a stochastic policy.

A family is one module of `flowrl.families` holding one ImageBackend subclass registered in FAMILIES (see the
package's docstring); this module holds what they share.

    backend = load_image_backend("stabilityai/stable-diffusion-3.5-medium", dtype=torch.bfloat16, device="cuda")
    traj = backend.rollout(prompts, group_size=8, num_steps=10, sde_window=SDEWindow.fixed(0, 4), seed=0)
    log_prob, mean, std = backend.step_log_prob(traj, traj.train_steps)      # with grad
    pred = backend.flow_prediction(x0, eps, t, prompt_ids, traj.prompt_encodings, traj.sampler)  # with grad

The first two are what GRPO trains (the sampler's own transitions); `flow_prediction` is what the forward-process
objectives (DiffusionNFT, AWM, Diffusion-DPO) train: the model's output at a re-noised clean sample, as a
rectified-flow velocity, for every family (a DDPM UNet's epsilon converted).

The denoiser is always reached through `backend.denoiser` (the pipeline's `transformer` / `unet`),
never a cached bound method, so a LoRA wrapper put in its place is what runs.

Before any weight is read, `preflight_image_model(path, height=..., width=...)` checks a model from its
configuration files alone (model_index.json, the denoiser's and the VAE's config.json): a pipeline class
some family drives, the family asked for, the image size, `drop_t5`. `load_image_backend` makes all of
them but the size's before it loads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from torch import Tensor

from flowrl.core.registry import Registry
from flowrl.errors import FlowrlError
from flowrl.plan.declarations import Calibration, Layout
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

FAMILIES: Registry[type[ImageBackend]] = Registry("image model family")


class ImageModelError(FlowrlError, ValueError):
    """A model that cannot be run as asked (unknown pipeline class, wrong family, image size, drop_t5, a
    configuration file missing, not reachable or not JSON, found before its weights are loaded; weights that do
    not load); the message says what would be right. A FlowrlError: the command line prints its line."""


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


class FlowPrediction(NamedTuple):
    """The model at a point of the rectified-flow path x_t = (1 - t) x0 + t eps (t in (0, 1], 1 = noise), as a
    velocity: what the forward-process objectives train (see `ImageBackend.flow_prediction`). All float32."""

    velocity: Tensor  # [N, ...] the model's prediction v_hat (with grad when grad is enabled)
    target: Tensor  # [N, ...] v = eps - x0
    x_t: Tensor  # [N, ...] (1 - t) x0 + t eps, so x0 = x_t - t v
    t: Tensor  # [N] the flow time of the pass (a DDPM family's nearest training timestep's)


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


def encode_prompt_per_prompt(pipe) -> None:
    """Make `pipe.encode_prompt` give each image its own prompt's encodings: it encodes once per prompt and repeats
    every output per prompt. SanaPipeline's and QwenImagePipeline's (as of diffusers 0.42.1) repeat the embeddings
    per prompt ([p0, p0, p1, p1]) but the attention masks per batch ([m0, m1, m0, m1]), so with several prompts
    and num_images_per_prompt > 1 an image attends through another prompt's padding mask; with this, `pipe(...)`
    conditions every image as a rollout does (correct whether or not diffusers fixes it). Applied once."""
    import inspect

    encode = pipe.encode_prompt
    if getattr(encode, "_flowrl_per_prompt", False):
        return
    signature = inspect.signature(encode)

    def encode_prompt(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        n = arguments.pop("num_images_per_prompt", 1) or 1
        out = encode(**arguments, num_images_per_prompt=1)
        return tuple(t if t is None else t.repeat_interleave(n, dim=0) for t in out)

    encode_prompt._flowrl_per_prompt = True
    encode_prompt.__doc__ = encode.__doc__
    pipe.encode_prompt = encode_prompt


def register_family(cls: type[ImageBackend]) -> type[ImageBackend]:
    """Class decorator: register a family's backend under its `family` name (what `model.family` takes)."""
    return FAMILIES.register(cls.family)(cls)


class ImageBackend:
    """A text-to-image pipeline as a policy. A family subclasses it, declares itself in the class attributes
    below and fills in the hooks at the end."""

    # ---- what a family declares ----------------------------------------------------------------
    family: ClassVar[str]  # its name: model.family, the tiny model "tiny-<family>"
    pipeline_classes: ClassVar[tuple[str, ...]]  # diffusers pipeline class names this backend drives
    denoiser_attr: ClassVar[str]  # the pipeline's trained component: "transformer" | "unet"
    denoiser_class: ClassVar[str]  # its diffusers model class, e.g. "SD3Transformer2DModel"
    sde_types: ClassVar[tuple[str, ...]]  # the step kernels it can sample with ("ode": deterministic)
    default_sde_type: ClassVar[str]
    default_guidance_scale: ClassVar[float]
    default_max_sequence_length: ClassVar[int | None] = None
    lora_targets: ClassVar[tuple[str, ...]]  # the denoiser's modules a LoRA adapts by default
    t5_components: ClassVar[tuple[str, ...]] = ()  # a T5 encoder the family runs without (drop_t5)
    #: conditioning images per prompt, (fewest, most): (0, 0) text-to-image, (1, 1) single-image editing
    condition_images: ClassVar[tuple[int, int]] = (0, 0)
    video: ClassVar[bool] = False  # a video family: its samples are frames [F, H, W, C] (`flowrl.video`)
    default_num_frames: ClassVar[int] = 1  # frames per sample when none are asked for (the pipeline's default)
    tiny_num_frames: ClassVar[int] = 1  # frames per sample of the tiny test model's runs
    tiny_denoiser: ClassVar[dict]  # the denoiser config of its tiny random-weight test model
    #: schedulers a directory of this family may ship that the backend swaps for the one it samples with: (diffusers
    #: class name, config beyond the model's noise schedule). The family tests check that such a directory trains.
    other_schedulers: ClassVar[tuple[tuple[str, dict], ...]] = ()
    #: how the memory planner (`flowrl plan`) reads `denoiser_class`: which layers see which token streams, which
    #: modules gradient checkpointing recomputes (flowrl.plan.declarations.Layout)
    plan_layout: ClassVar[Layout]
    #: the planner's activation factors for `denoiser_class`: measured by benchmarks/memory.py, borrowed from a
    #: similar measured class (`Calibration.borrowed`), or `NOT_CALIBRATED`; its `measured` says which
    plan_calibration: ClassVar[Calibration]
    #: the denoiser's attributes holding its repeated blocks (ModuleLists), which rollout.acceleration's `compile`
    #: compiles one by one; () = those diffusers declares in the model class's `_repeated_blocks`
    repeated_blocks: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def condition_tokens(cls, height: int, width: int, tokens_at) -> tuple[int, int]:
        """What one conditioning image adds to a model row, for the memory planner (`flowrl.plan`): (denoiser
        image tokens, text-encoding tokens). `tokens_at(h, w)` is the denoiser's token count of an h x w image.
        None by default: text-to-image, or a condition that rides in the latents' channels (Wan's image-to-video)."""
        return 0, 0

    @classmethod
    def tiny_pipeline(cls, seed: int = 0, **options):
        """A tiny random-weight pipeline of this family, built offline in code (tests, smoke runs); its weights
        depend only on `seed`."""
        raise NotImplementedError

    @classmethod
    def tiny_config_files(cls) -> dict[str, dict]:
        """What a check before loading reads of the tiny model (model_index.json, the denoiser's and the
        VAE's config.json), without building it: the entries that matter, not every key save_pretrained
        writes."""
        from ._tiny import VAE_BLOCK_OUT_CHANNELS

        return {
            "model_index.json": {
                "_class_name": cls.pipeline_classes[0],
                cls.denoiser_attr: ["diffusers", cls.denoiser_class],
                "vae": ["diffusers", "AutoencoderKL"],
            },
            f"{cls.denoiser_attr}/config.json": {"_class_name": cls.denoiser_class, **cls.tiny_denoiser},
            "vae/config.json": {"_class_name": "AutoencoderKL", "block_out_channels": list(VAE_BLOCK_OUT_CHANNELS)},
        }

    @classmethod
    def check_num_frames(cls, num_frames: int | None) -> int:
        """The frames per sample to make: `num_frames`, or the family's default for None or 0; an
        ImageModelError if the family cannot make that many (an image family makes 1)."""
        if not num_frames:
            return cls.default_num_frames
        if not cls.video and num_frames != 1:
            raise ImageModelError(f"{cls.family} makes images: sample.num_frames must be 1 (or 0), got {num_frames}")
        if num_frames < 1:
            raise ImageModelError(f"sample.num_frames must be >= 1 (or 0 = {cls.default_num_frames}), got {num_frames}")
        return num_frames

    #: guidance scales the parity test samples `pipe(...)` with (with and without CFG where the family has it)
    parity_guidance: ClassVar[tuple[float, ...]] = (1.0, 4.5)

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        """The keyword arguments with which the pipeline's own `pipe(prompts, ...)` samples as a deterministic
        rollout with `guidance_scale` does (besides prompts, steps, size, latents): what the parity test and
        users comparing against diffusers pass."""
        kwargs = {"guidance_scale": guidance_scale}
        if self.default_max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.max_sequence_length
        return kwargs

    def pipeline_batches(self, prompts: Sequence[str], per_prompt: int) -> list[dict]:
        """The `pipe(...)` calls that make `per_prompt` samples of each prompt, prompt-major as a rollout orders
        them: each call's prompts and `num_images_per_prompt` (a video pipeline's `num_videos_per_prompt`); the
        calls' samples, in order, are the rollout's. One call unless the pipeline cannot take the batch at once."""
        key = "num_videos_per_prompt" if self.video else "num_images_per_prompt"
        return [{"prompt": list(prompts), key: per_prompt}]

    def pipeline_condition_kwargs(self, images: Sequence, height: int, width: int) -> dict:
        """The `pipe(...)` arguments that give every prompt of the call the conditioning images `images` (one prompt's
        list, the count the family takes) as a rollout of height x width pixels encodes them: e.g. the source
        image of an edit. {} for a family that takes none."""
        if self.condition_images[1]:
            raise NotImplementedError(
                f"{self.family} takes conditioning images but does not say how pipe(...) takes "
                f"them (pipeline_condition_kwargs)"
            )
        return {}

    def pipeline_latents(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Initial latents [B, ...] of a rollout (the denoiser's layout) as the pipeline's `pipe(latents=...)`
        takes them, for sampling the same images with diffusers (the denoising loop's own latents, which
        callbacks see, are in the denoiser's layout). The same tensor unless the pipeline packs its input."""
        return latents

    @classmethod
    def export_lora(cls, pipeline_class, directory, state: dict, metadata: dict) -> None:
        """Write a trained LoRA (peft state dict of the denoiser, and its adapter config) in the format the
        pipeline's own `load_lora_weights(directory)` reads."""
        kwargs = {f"{cls.denoiser_attr}_lora_layers": state, f"{cls.denoiser_attr}_lora_adapter_metadata": metadata}
        pipeline_class.save_lora_weights(directory, safe_serialization=True, **kwargs)

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
        self._parked_text = self._parked_vae = None  # train.offload (see `offload`)
        self.compute_dtype: torch.dtype | None = None  # see `dtype`

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
        """The denoiser's compute dtype: its weights', or `compute_dtype` when they are float32 masters gathered
        in another dtype for the forward (full fine-tuning in bf16 under FSDP)."""
        return self.compute_dtype or next(self.denoiser.parameters()).dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.pipe).__name__}, dtype={self.dtype}, device={self.device})"

    def offload(self, device: torch.device | str) -> None:
        """Keep the text encoders and the VAE in CPU memory, on `device` only while they run: the encoders while
        prompts are encoded (encodings are cached, so once per new prompt), the VAE while a rollout decodes."""
        from flowrl.offload import Parked

        modules = {
            n: m for n, m in self.pipe.components.items() if isinstance(m, torch.nn.Module) and n != self.denoiser_attr
        }
        self._parked_vae = Parked([m for n, m in modules.items() if n == "vae"], device)
        self._parked_text = Parked([m for n, m in modules.items() if n != "vae"], device)

    def _encode(self, prompts: list[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """`_encode_text`, with the text encoders on the device for it when they are offloaded."""
        from flowrl.offload import visiting

        with visiting(self._parked_text):
            return self._encode_text(prompts)

    # ---- prompts ---------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEncodings:
        """Encodings of the distinct prompts among `prompts` (first-appearance order), each computed once
        and kept in an LRU cache across calls; with the unconditional encodings if the family uses CFG."""
        distinct = list(dict.fromkeys(prompts))
        missing = [p for p in distinct if p not in self._prompt_cache]
        if missing:
            per_prompt, shared = self._encode(missing)
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
            self._negative, _ = self._encode([""])
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
        num_frames: int | None = None,
        images: Sequence[Sequence] | None = None,
        record_means: bool = False,
        keep_steps: bool = True,
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
        num_frames: a video family's frames per sample (default: the family's, `default_num_frames`); images: 1.
        images: the conditioning images of each prompt (P lists of PIL images, each the count the family takes,
            `condition_images`), or None for none; encoded once per prompt by `_encode_conditions` and kept per
            sample in `traj.conditions`.
        record_means: also keep the transition means [B, S, ...] (float32; memory heavy).
        keep_steps: False keeps only the final sample (traj.latents [B, 1, ...], no log-probs): what the
            forward-process objectives need, without S copies of the latents.
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
        settings = self.sampler_settings(
            sde_type,
            noise_level=noise_level,
            guidance_scale=guidance_scale,
            logprob_reduce=logprob_reduce,
            height=height,
            width=width,
            num_frames=num_frames,
        )
        sde_mask = as_sde_window(sde_window).mask(num_steps, epoch)
        if sde_type == "ode":
            sde_mask[:] = False
        if seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(seed)

        encodings = self.encode_prompts(prompts)
        conditions = self.encode_conditions(images, len(prompts), settings, group_size, prompts=prompts)
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
        cond = self._condition(encodings, prompt_ids, conditions)
        cond_per_group = None
        if shared_until:
            per_group = {name: t[::group_size] for name, t in conditions.items()}
            cond_per_group = self._condition(encodings, prompt_ids[::group_size], per_group)

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

        chain = record_chain(
            denoise, step, latents, sde_mask.to(self.device), record_means=record_means, keep_steps=keep_steps
        )
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
            conditions=conditions,
        )
        if decode:
            from flowrl.offload import visiting

            with visiting(self._parked_vae):
                traj.images = self.decode(traj.final_latents, height=settings.height, width=settings.width)
        return traj

    def sampler_settings(
        self,
        sde_type: str,
        *,
        noise_level: float | None = None,
        guidance_scale: float | None = None,
        logprob_reduce: str = "mean",
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
    ) -> SamplerSettings:
        """The SamplerSettings of a rollout with these arguments (see `rollout`; None: the defaults), the size and
        frame count checked."""
        height, width = self.check_image_size(height, width)
        return SamplerSettings(
            family=self.family,
            sde_type=sde_type,
            noise_level=float(DEFAULT_NOISE_LEVEL.get(sde_type, 1.0) if noise_level is None else noise_level),
            guidance_scale=float(self.default_guidance_scale if guidance_scale is None else guidance_scale),
            logprob_reduce=logprob_reduce,
            height=height,
            width=width,
            num_frames=self.check_num_frames(num_frames),
        )

    def latent_shape(
        self, height: int | None = None, width: int | None = None, num_frames: int | None = None
    ) -> tuple[int, ...]:
        """The shape of one clean sample of this size in the denoiser's layout (a rollout's `final_latents[i]`), e.g.
        [C, h, w] or FLUX's packed [L, C]."""
        return tuple(
            self._latent_shape(self.sampler_settings("ode", height=height, width=width, num_frames=num_frames))
        )

    @torch.no_grad()
    def final_trajectory(
        self,
        prompts: Sequence[str],
        final_latents: Tensor,
        *,
        num_steps: int,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        images: Sequence[Sequence] | None = None,
    ) -> Trajectory:
        """What `rollout(prompts, num_steps=..., sde_type="ode", keep_steps=False, decode=False)` records, holding
        the given clean samples `final_latents` [B, ...] (one per prompt, in the layout `latent_shape` gives) in
        place of sampled ones: the schedule, the prompts' encodings and the conditioning `images` (as `rollout`
        takes them), nothing sampled. What the forward-process objectives train on data read from files (offline
        Diffusion-DPO's pairs)."""
        prompts = list(prompts)
        settings = self.sampler_settings(
            "ode", guidance_scale=guidance_scale, height=height, width=width, num_frames=num_frames
        )
        expected = (len(prompts), *self._latent_shape(settings))
        if tuple(final_latents.shape) != expected:
            raise ValueError(
                f"final_latents must have shape {expected} (one sample per prompt), got {tuple(final_latents.shape)}"
            )
        encodings = self.encode_prompts(prompts)
        conditions = self.encode_conditions(images, len(prompts), settings, prompts=prompts)
        schedule = self._schedule(num_steps, settings)
        return Trajectory(
            latents=final_latents[:, None].to(self.device, self.dtype),
            log_probs=None,
            stds=None,
            timesteps=schedule.timesteps,
            sde_mask=torch.zeros(num_steps, dtype=torch.bool, device=self.device),
            prompts=prompts,
            prompt_ids=encodings.ids_for(prompts).to(self.device),
            group_ids=torch.arange(len(prompts), device=self.device),
            prompt_encodings=encodings,
            sampler=settings,
            sigmas=schedule.sigmas,
            alphas_cumprod=schedule.alphas_cumprod,
            alphas_cumprod_prev=schedule.alphas_cumprod_prev,
            conditions=conditions,
        )

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
        if not traj.records_steps:
            raise ValueError(
                "this trajectory kept only its final sample (a rollout with keep_steps=False): it has no "
                "recorded step to score; roll out with keep_steps=True"
            )
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
        cond = self._condition(
            encodings,
            traj.prompt_ids[rows_k.to(traj.prompt_ids.device)],
            {name: t[rows_k.to(t.device)] for name, t in traj.conditions.items()},
        )
        steps_dev = steps_k.to(self.device)
        model_output = self._predict(x, schedule.timesteps[steps_dev], cond, encodings, traj.sampler)
        out = self._step(model_output, x, steps_dev, schedule, traj.sampler, stochastic=True, prev_latents=x_prev)

        def per_sample(t: Tensor) -> Tensor:  # [K*b, ...] -> [b, K, ...] (or [b, ...] for one step)
            t = t.reshape(n_steps, n_rows, *t.shape[1:]).transpose(0, 1)
            return t[:, 0] if single else t

        return StepLogProb(per_sample(out.log_prob), per_sample(out.mean), per_sample(out.std))

    def flow_prediction(
        self,
        x0: Tensor,
        noise: Tensor,
        t: Tensor | float,
        prompt_ids: Tensor,
        encodings: PromptEncodings,
        settings: SamplerSettings,
        conditions: Mapping[str, Tensor] | None = None,
        guidance_scale: float | None = None,
    ) -> FlowPrediction:
        """The model's prediction at a re-noised clean sample, as a rectified-flow velocity, WITH grad (when grad is
        enabled) and without CFG: what DiffusionNFT, AWM and Diffusion-DPO train.

        x0: [N, ...] clean latents in the denoiser's layout (a rollout's `final_latents`); noise: [N, ...] eps;
        t: [N] (or a float) flow times in (0, 1], 1 = noise; prompt_ids: [N] rows of `encodings`;
        settings: the rollout's SamplerSettings (its size; its guidance scale becomes the CFG-free value of
        `training_guidance_scale`, one forward pass); conditions: name -> [N, ...] the rows' encoded conditioning
        inputs (a rollout's `traj.conditions` at those rows), for a family that takes them; guidance_scale: None
        (the CFG-free pass), or the guidance of a guided prediction (a CFG-guided teacher: with true CFG above 1, one
        batched pass over [uncond, cond] combined as the rollout combines them; FLUX dev's embedded guidance).
        Flow families evaluate x_t = (1 - t) x0 + t eps at the denoiser timestep of t (the scheduler's
        num_train_timesteps x t, what a rollout at sigma = t passes); their `_predict` already returns the velocity
        in flowrl's convention (Z-Image's negation included). DDPM families evaluate x = alpha x0 + sigma eps at
        the training timestep whose flow time sigma / (alpha + sigma) is nearest t (exact for a rollout's own
        schedule times, `flow_times`) and convert the prediction (`ddpm_velocity`); x / (alpha + sigma) is x_t.
        Returns FlowPrediction(velocity, target = eps - x0, x_t, t) in float32; `t` is the time actually used.
        """
        if x0.shape != noise.shape:
            raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have one shape")
        n = x0.shape[0]
        t = torch.as_tensor(t, dtype=torch.float32, device=self.device)
        t = t.expand(n) if t.ndim == 0 else t.reshape(-1)
        if t.shape != (n,):
            raise ValueError(f"t must be a float or [N] = [{n}] flow times, got shape {tuple(t.shape)}")
        if not bool(((t > 0) & (t <= 1)).all()):
            raise ValueError(f"flow times must lie in (0, 1] (1 = noise), got {t.min().item():g}..{t.max().item():g}")
        x0, noise = x0.to(self.device, torch.float32), noise.to(self.device, torch.float32)
        t, x_in, timesteps, to_velocity = self._flow_input(x0, noise, t)
        scale = self.training_guidance_scale(settings.guidance_scale) if guidance_scale is None else guidance_scale
        train_settings = replace(settings, guidance_scale=float(scale))
        cond = self._condition(encodings, prompt_ids, conditions)
        out = self._predict(x_in.to(self.dtype), timesteps, cond, encodings, train_settings)
        tc = t.view(n, *([1] * (x0.ndim - 1)))
        return FlowPrediction(to_velocity(out).float(), noise - x0, (1 - tc) * x0 + tc * noise, t)

    def flow_times(self, traj: Trajectory) -> Tensor:
        """[S] float32: the flow time t in (0, 1] of each step of a rollout's schedule (where step i starts)."""
        raise NotImplementedError

    def training_guidance_scale(self, guidance_scale: float) -> float:
        """The guidance value of a CFG-free forward pass for a rollout sampled with `guidance_scale`: 1 (no CFG) for
        families whose CFG is on above 1. A family whose guidance is an embedding (FLUX.1 / FLUX.2 dev) keeps the
        rollout's value (it costs no second pass), one whose CFG is on above 0 (Z-Image) returns 0."""
        return 1.0

    @torch.no_grad()
    def decode(self, latents: Tensor, *, height: int | None = None, width: int | None = None) -> list:
        """[B, ...] final latents (denoiser layout) -> B PIL images (a video family: B uint8 arrays [F, H, W, C])."""
        vae = self.pipe.vae
        image = vae.decode(self._to_vae_latents(latents, height, width).to(vae.device, vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")

    @torch.no_grad()
    def encode_images(self, images: Sequence, *, height: int | None = None, width: int | None = None) -> Tensor:
        """B PIL images -> [B, ...] clean latents in the denoiser's layout and space, where a rollout's
        `final_latents` live (so `decode` gives the images back, up to the VAE's loss): the images as
        `pipe.image_processor` prepares them at height x width (resized if they are another size), the VAE's mode
        (`_vae_encode`), then scaled, shifted and packed as the family's pipeline prepares image latents
        (`_from_vae_latents`, the inverse of `_to_vae_latents`). A video family is refused (ValueError)."""
        if self.video:
            raise ValueError(f"{self.family} makes videos, not images: give its clean samples as latents")
        from flowrl.offload import visiting

        height, width = self.check_image_size(height, width)
        pixels = self.pipe.image_processor.preprocess(list(images), height, width)  # [B, 3, H, W] in [-1, 1]
        with visiting(self._parked_vae):
            latents = self._vae_encode(pixels)
        return self._from_vae_latents(latents, height, width).to(self.device, self.dtype)

    def _vae_encode(self, pixels: Tensor) -> Tensor:
        """[B, 3, H, W] pixels in [-1, 1] -> the VAE's latents (its distribution's mode; a deterministic
        autoencoder's latent, SANA's DC-AE), float32."""
        vae = self.pipe.vae
        out = vae.encode(pixels.to(vae.device, vae.dtype))
        return (out.latent_dist.mode() if hasattr(out, "latent_dist") else out.latent).float()

    def _from_vae_latents(self, latents: Tensor, height: int, width: int) -> Tensor:
        """The VAE's latents [B, ...] (`_vae_encode`) -> the denoiser's layout and space: `_to_vae_latents`'
        inverse."""
        raise NotImplementedError(f"{self.family} does not encode images into its latents")

    # ---- shared helpers --------------------------------------------------------------------------

    def _condition(
        self, encodings: PromptEncodings, prompt_ids: Tensor, conditions: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """What `_predict` conditions on for N samples: the prompt encodings' rows `prompt_ids` [N] and the
        samples' encoded conditioning inputs (name -> [N, ...], names distinct from the encodings')."""
        cond = encodings.gather(prompt_ids)
        clash = sorted(set(cond) & set(conditions or {}))
        if clash:
            raise ValueError(f"{self.family}: conditioning inputs {clash} have the names of prompt encodings")
        cond.update(conditions or {})
        return {name: t.to(self.device) for name, t in cond.items()}

    def encode_conditions(
        self,
        images: Sequence[Sequence] | None,
        num_prompts: int,
        settings: SamplerSettings,
        group_size: int = 1,
        prompts: Sequence[str] | None = None,
    ) -> dict[str, Tensor]:
        """The conditioning images of P prompts (P lists of PIL images, or None) encoded for `_predict`, one row
        per sample: name -> [P x group_size, ...] (prompt-major). A ValueError when a prompt's count is not what
        the family takes (`condition_images`); {} for a family that takes none. prompts: the P prompts' texts,
        for a family that encodes them together with their images (Qwen-Image-Edit's vision-language encoder)."""
        from flowrl.conditioning import count_problem

        images = [[] for _ in range(num_prompts)] if images is None else [list(x) for x in images]
        if len(images) != num_prompts:
            raise ValueError(
                f"images: one list of conditioning images per prompt, got {len(images)} lists for {num_prompts} prompts"
            )
        for p, given in enumerate(images):
            problem = count_problem(len(given), self.condition_images, self.family)
            if problem:
                raise ValueError(f"images of prompt {p}: {problem}")
        if self.condition_images[1] == 0:
            return {}
        from flowrl.offload import visiting

        # the image encoders and the VAE run here: on the device for it when train.offload parks them
        with torch.no_grad(), visiting(self._parked_text), visiting(self._parked_vae):
            per_prompt = self._encode_conditions(images, settings, list(prompts) if prompts is not None else None)
        return {name: t.repeat_interleave(group_size, dim=0) for name, t in per_prompt.items()}

    def _encode_conditions(
        self, images: list[list], settings: SamplerSettings, prompts: list[str] | None = None
    ) -> dict[str, Tensor]:
        """A family that takes conditioning images: P prompts' images (each list the count it takes) -> name ->
        [P, ...] tensors on the model's device, which `_predict` finds in its `cond` (e.g. the VAE latents of a
        source image). prompts: the P prompts' texts (None when the caller has none)."""
        raise NotImplementedError(
            f"{self.family} declares condition_images={self.condition_images} but does not "
            f"encode them (_encode_conditions)"
        )

    @property
    def size_multiple(self) -> int:
        """What each side of an image this model makes (and of a conditioning image) is a multiple of, in pixels."""
        return self.size_rule(self.denoiser_config, self.spatial_vae_factor).multiple

    @property
    def spatial_vae_factor(self) -> int:
        """How many pixels a latent spans a side: the pipeline's `vae_scale_factor` (a video pipeline's
        `vae_scale_factor_spatial`)."""
        factor = getattr(self.pipe, "vae_scale_factor", None)
        return factor if factor is not None else self.pipe.vae_scale_factor_spatial

    def _negative_like(self, encodings: PromptEncodings, n: int) -> dict[str, Tensor]:
        return {name: t.to(self.device) for name, t in encodings.negative_rows(n).items()}

    def check_image_size(self, height: int | None = None, width: int | None = None) -> tuple[int, int]:
        """(height, width) in pixels, the pipeline's default for None; an ImageModelError if the model
        cannot make that size (see `size_rule`)."""
        default = self._default_image_size()
        height, width = height or default, width or default
        self.size_rule(self.denoiser_config, self.spatial_vae_factor).check(height, width)
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

    def _flow_input(self, x0: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor, Callable]:
        """For `flow_prediction`: x0, noise [N, ...] float32, t [N] flow times -> (t used [N], the model's input
        latents [N, ...] float32, its denoiser timesteps [N], a function model output -> flow velocity)."""
        raise NotImplementedError

    def _to_vae_latents(self, latents: Tensor, height: int | None, width: int | None) -> Tensor:
        raise NotImplementedError
