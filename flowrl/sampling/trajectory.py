"""What a rollout records: the latents of every step, their log-probs, and what is needed to redo a step.

B samples (prompts x group_size), S denoising steps. Step i maps latents[:, i] to latents[:, i + 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor


def _move(value, device):
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, PromptEncodings):
        return value.to(device)
    return value


@dataclass
class PromptEncodings:
    """Text-encoder outputs for P distinct prompts, computed once each and shared by their group.

    prompts:    the P distinct prompts, row p of every `per_prompt` tensor belongs to prompts[p].
    per_prompt: name -> [P, ...] (e.g. prompt_embeds [P, L, D], pooled_prompt_embeds [P, D]).
    shared:     name -> tensor used as-is for every sample (e.g. FLUX's txt_ids [L, 3]).
    negative:   name -> [1, ...] unconditional encodings for classifier-free guidance, or None.
    """

    prompts: list[str]
    per_prompt: dict[str, Tensor]
    shared: dict[str, Tensor] = field(default_factory=dict)
    negative: dict[str, Tensor] | None = None

    def ids_for(self, prompts: Sequence[str]) -> Tensor:
        """[len(prompts)] long: the row of each prompt."""
        row = {p: i for i, p in enumerate(self.prompts)}
        missing = [p for p in prompts if p not in row]
        if missing:
            raise KeyError(f"prompts not encoded here: {missing[:3]}")
        return torch.tensor([row[p] for p in prompts], dtype=torch.long)

    def gather(self, prompt_ids: Tensor) -> dict[str, Tensor]:
        """The per-sample conditioning: name -> [N, ...] rows `prompt_ids` of each per-prompt tensor."""
        out = {}
        for name, t in self.per_prompt.items():
            out[name] = t[prompt_ids.to(t.device)]
        return out

    def negative_rows(self, n: int) -> dict[str, Tensor]:
        """name -> [n, ...] the unconditional encodings repeated n times."""
        if self.negative is None:
            raise ValueError("these prompt encodings carry no unconditional (negative) encodings for CFG")
        return {name: t.expand(n, *t.shape[1:]) for name, t in self.negative.items()}

    def to(self, device) -> PromptEncodings:
        return PromptEncodings(
            list(self.prompts), _move(self.per_prompt, device), _move(self.shared, device), _move(self.negative, device)
        )

    @staticmethod
    def merge(encodings: Sequence[PromptEncodings]) -> tuple[PromptEncodings, list[Tensor]]:
        """The union of several encodings (of one backend), and for each input a [P_i] long tensor
        mapping its rows to the merged rows."""
        prompts: list[str] = []
        row_of: dict[str, int] = {}
        rows: dict[str, list[Tensor]] = {name: [] for name in encodings[0].per_prompt}
        for enc in encodings:
            for i, p in enumerate(enc.prompts):
                if p not in row_of:
                    row_of[p] = len(prompts)
                    prompts.append(p)
                    for name in rows:
                        rows[name].append(enc.per_prompt[name][i : i + 1])
        remaps = [torch.tensor([row_of[p] for p in enc.prompts], dtype=torch.long) for enc in encodings]
        first = encodings[0]
        merged = PromptEncodings(prompts, {n: torch.cat(r) for n, r in rows.items()}, first.shared, first.negative)
        return merged, remaps


@dataclass(frozen=True)
class SamplerSettings:
    """How a rollout took its steps: everything a backend needs to redo one of them."""

    family: str  # "sd3" | "flux" | "sd15"
    sde_type: str  # "sde" | "cps" | "dance" | "ode" (flow) or "ddim" | "ode" (sd15)
    noise_level: float  # a / CPS angle fraction / eta
    guidance_scale: float  # CFG scale (sd3, sd15) or the embedded guidance (flux)
    logprob_reduce: str  # "mean" | "sum"
    height: int
    width: int
    num_frames: int = 1  # a video family's frames per sample (1: an image)


@dataclass
class Trajectory:
    """A batch of B denoising trajectories of S steps.

    latents:      [B, S+1, ...] latents in the denoiser's layout and dtype (FLUX: packed [B, S+1, L, C]);
                  latents[:, 0] is the initial noise, latents[:, S] the final sample. A rollout that kept only
                  its final sample (`keep_steps=False`: what the forward-process objectives train on) holds
                  [B, 1, ...], and no log_probs or stds (`records_steps` is False).
    log_probs:    [B, S] float32 log-prob of each recorded transition (0 on deterministic steps), or None.
    stds:         [S] float32 std of each step's transition (0 on deterministic steps), or None.
    timesteps:    [S] the denoiser's timestep at each step (float32 for flow models, int64 for DDIM).
    sde_mask:     [S] bool, True where the step was stochastic: the steps that are trained.
    prompts:      [B] the prompt of each sample.
    prompt_ids:   [B] long, row of each sample's prompt in `prompt_encodings`.
    group_ids:    [B] long, samples of one prompt in one rollout call share a group id.
    prompt_encodings: the encodings of the distinct prompts (shared, not copied, by `select`).
    sigmas:       [S+1] float32 flow-time schedule (flow families), or None.
    alphas_cumprod: [S] float32 alpha-bar at each step's t (DDIM), or None.
    alphas_cumprod_prev: [S] float32 alpha-bar at the t each step goes to (DDIM), or None.
    means:        [B, S, ...] float32 transition means, when the rollout was asked to record them.
    images:       B samples decoded from latents[:, S]: PIL images, or a video family's uint8 frames
                  [F, H, W, C] (`flowrl.video`); or None.
    conditions:   name -> [B, ...] the samples' encoded conditioning inputs (an editing family's source-image
                  latents), {} for a text-only rollout; per sample, like the latents.
    sampler:      the SamplerSettings the steps were taken with.
    """

    latents: Tensor
    log_probs: Tensor | None
    stds: Tensor | None
    timesteps: Tensor
    sde_mask: Tensor
    prompts: list[str]
    prompt_ids: Tensor
    group_ids: Tensor
    prompt_encodings: PromptEncodings
    sampler: SamplerSettings
    sigmas: Tensor | None = None
    alphas_cumprod: Tensor | None = None
    alphas_cumprod_prev: Tensor | None = None
    means: Tensor | None = None
    images: list | None = None
    conditions: dict[str, Tensor] = field(default_factory=dict)

    # Fields indexed by sample in `select`; everything else is per step or shared.
    _PER_SAMPLE = ("latents", "log_probs", "prompt_ids", "group_ids", "means")

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def records_steps(self) -> bool:
        """Whether every step's latents and log-prob were kept (False: only the final sample)."""
        return self.log_probs is not None

    @property
    def train_steps(self) -> list[int]:
        """Indices of the stochastic (trainable) steps."""
        return torch.nonzero(self.sde_mask.cpu()).flatten().tolist()

    @property
    def final_latents(self) -> Tensor:
        return self.latents[:, -1]

    def select(self, indices: Sequence[int] | Tensor) -> Trajectory:
        """The sub-batch of samples `indices` (for minibatching); per-step fields and the prompt
        encodings are shared with this trajectory, not copied."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-d, got shape {tuple(idx.shape)}")
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"sample indices must lie in [0, {len(self)}), got {idx.tolist()}")
        changes = {}
        for name in self._PER_SAMPLE:
            value = getattr(self, name)
            if value is not None:
                changes[name] = value[idx.to(value.device)]
        il = idx.tolist()
        changes["prompts"] = [self.prompts[i] for i in il]
        if self.images is not None:
            changes["images"] = [self.images[i] for i in il]
        changes["conditions"] = {name: t[idx.to(t.device)] for name, t in self.conditions.items()}
        return replace(self, **changes)

    @classmethod
    def cat(cls, trajectories: Sequence[Trajectory]) -> Trajectory:
        """One trajectory holding the samples of several rollouts taken with the same sampler, schedule
        and SDE mask (e.g. the rollout batches of one epoch). Group ids are offset so that groups of
        different rollouts stay apart; prompt encodings are merged."""
        trajectories = list(trajectories)
        if not trajectories:
            raise ValueError("Trajectory.cat needs at least one trajectory")
        first = trajectories[0]
        for t in trajectories[1:]:
            same = t.sampler == first.sampler and all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in (
                    (t.timesteps, first.timesteps),
                    (t.sde_mask, first.sde_mask),
                    (t.sigmas, first.sigmas),
                    (t.alphas_cumprod, first.alphas_cumprod),
                    (t.alphas_cumprod_prev, first.alphas_cumprod_prev),
                )
            )
            if not same:
                raise ValueError(
                    "Trajectory.cat joins rollouts of one sampler, schedule and SDE mask; these differ "
                    f"({t.sampler} vs {first.sampler}, sde_mask {t.sde_mask.tolist()} vs {first.sde_mask.tolist()})"
                )
        encodings, remaps = PromptEncodings.merge([t.prompt_encodings for t in trajectories])
        group_ids, offset = [], 0
        for t in trajectories:
            group_ids.append(t.group_ids + offset)
            offset += int(t.group_ids.max()) + 1 if len(t) else 0

        def joined(name):
            values = [getattr(t, name) for t in trajectories]
            return None if any(v is None for v in values) else torch.cat(values)

        prompt_ids = [r.to(t.prompt_ids.device)[t.prompt_ids] for r, t in zip(remaps, trajectories, strict=True)]
        names = [sorted(t.conditions) for t in trajectories]
        if any(n != names[0] for n in names):
            raise ValueError(f"Trajectory.cat joins rollouts with the same conditioning inputs, got {names}")
        conditions = {name: torch.cat([t.conditions[name] for t in trajectories]) for name in names[0]}
        images = None
        if all(t.images is not None for t in trajectories):
            images = [image for t in trajectories for image in t.images]

        return replace(
            first,
            latents=joined("latents"),
            log_probs=joined("log_probs"),
            means=joined("means"),
            prompts=[p for t in trajectories for p in t.prompts],
            prompt_ids=torch.cat(prompt_ids),
            group_ids=torch.cat(group_ids),
            prompt_encodings=encodings,
            images=images,
            conditions=conditions,
        )

    def to(self, device) -> Trajectory:
        """A copy with every tensor (including the prompt encodings) on `device`."""
        return replace(self, **{f.name: _move(getattr(self, f.name), device) for f in fields(self)})
