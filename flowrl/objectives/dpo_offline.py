"""Offline Diffusion-DPO (Wallace et al., arXiv 2311.12908): Diffusion-DPO on preference pairs read from a file,
nothing sampled.

train.dpo_offline.pairs names a .jsonl file or a `hf:` dataset of rows {prompt, chosen, rejected, ...}
(`flowrl.data.load_pairs`; the format is in docs/training.md): the chosen and the rejected sample are images of
sample.height x sample.width (not resized: another size is refused before the model loads), which the family's VAE
encodes into the space of a rollout's final latents, or `.safetensors` files of those latents (key `latents`,
one sample's shape, checked once the model is loaded). The pairs are the training set: each epoch takes
sample.prompts_per_epoch of them as the trainer walks training prompts (a seeded shuffle from train.seed, passes
in order across epochs, data.balance_by if set), each a group of two samples (sample.group_size must be 2): row
2k is pair k's chosen sample, row 2k + 1 its rejected one. No reward scores them; the evals score with the
configured rewards as in any run. The loss is online DPO's (`DPO.row_losses`, core.dpo_loss) at the times of
the run's schedule (sample.num_steps), so beta, weighting and timesteps mean what they mean under train.dpo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.errors import DataError

from . import register
from ._forward import ForwardProcessObjective
from .dpo import DPO, DPOSettings


@dataclass
class DPOOfflineSettings(DPOSettings):
    pairs: str = ""
    """The preference pairs: a .jsonl file (one JSON object per line: `prompt`, `chosen`, `rejected`, other keys
    metadata; the samples are images of sample.height x sample.width or `.safetensors` latents, paths relative to
    the file) or hf:ORG/NAME (hf:DIR a local copy; split data.train_split). Required by train.objective=dpo_offline,
    whose training set it is (data.train_prompts is not read)."""


def _side(row: int) -> str:
    """Which sample of its pair batch row `row` holds."""
    return "rejected" if row % 2 else "chosen"


@register
class DPOOffline(DPO):
    """Offline Diffusion-DPO (see the module docstring)."""

    name = "dpo_offline"
    title = "offline Diffusion-DPO"
    Settings = DPOOfflineSettings
    scores_batch = False

    def __init__(self, cfg, policy, num_processes=1):
        super().__init__(cfg, policy, num_processes)
        self.shape: tuple[int, ...] | None = None  # one sample's latent shape (`check_data`)

    # ---- before the model loads

    @classmethod
    def check(cls, cfg):
        problems = super().check(cfg)
        if cfg.rollout.async_:
            problems.append(
                "rollout.async samples the next epoch in a worker; train.objective=dpo_offline samples nothing "
                "(it reads its pairs): set rollout.async=false"
            )
        if cfg.train.dpo_offline.pairing != "best_worst":
            problems.append(
                f"train.dpo_offline.pairing={cfg.train.dpo_offline.pairing}: the pairing of online DPO's groups; "
                "offline DPO's pairs are the rows of train.dpo_offline.pairs (leave pairing at best_worst)"
            )
        return problems

    @classmethod
    def training_prompts(cls, cfg):
        """The pairs of train.dpo_offline.pairs (their images checked to be of the run's size)."""
        from flowrl.data import PromptFileError, load_pairs
        from flowrl.errors import ConfigError

        key = "train.dpo_offline.pairs"
        if not cfg.train.dpo_offline.pairs:
            raise ConfigError(
                f"{key} is unset: train.objective=dpo_offline trains on preference pairs read from a .jsonl file "
                f"or hf:ORG/NAME (rows {{prompt, chosen, rejected}}); set {key}=PATH"
            )
        s = cfg.sample
        if s.group_size != 2:
            raise ConfigError(
                f"train.objective=dpo_offline makes each pair a group of 2 samples (chosen, rejected): set "
                f"sample.group_size=2 (now {s.group_size}); sample.prompts_per_epoch is the pairs of an epoch"
            )
        try:
            return load_pairs(
                cfg.train.dpo_offline.pairs,
                size=(s.height, s.width),
                image_column=cfg.data.image_column,
                split=cfg.data.train_split,
            )
        except PromptFileError as e:
            raise type(e)(f"{key}: {e}") from None

    # ---- the model loaded

    def check_data(self, train_set):
        """Every latents file holds one sample of the model's shape at this run's size (from the files' headers); an
        image needs an image family."""
        from flowrl.data import latents_shape

        self.shape = tuple(self.policy.latent_shape())
        for where, meta in zip(train_set.origins, train_set.metadata):
            for side in ("chosen", "rejected"):
                path = meta[side]
                if _is_latents(path):
                    self._check_shape(latents_shape(path), path, where, side)
                elif self.policy.backend.video:
                    raise DataError(
                        f"train.dpo_offline.pairs: {where}: {side} is an image, and {self.policy.family} makes "
                        f"videos: give its samples as .safetensors latents"
                    )

    def _check_shape(self, shape: tuple[int, ...], path: str, where: str, side: str) -> None:
        if tuple(shape) != self.shape:
            raise DataError(
                f"train.dpo_offline.pairs: {where}: {side} latents {path} have shape {list(shape)}, and the model's "
                f"samples at this run's size (sample.height, sample.width, sample.num_frames) {list(self.shape)}: "
                f"save latents of that shape"
            )

    # ---- the epoch

    def rollout(self, prompts, metadata, *, epoch, generator, stop=None, on_chunk=None):
        """The epoch's pairs as a batch, nothing sampled: row 2k is pair k's chosen sample, row 2k + 1 its rejected
        one (the trainer's groups of 2), each as clean latents: a latents file read, an image VAE-encoded
        (`ImagePolicy.encode_images`, in calls of sample.rollout_batch_size images)."""
        from flowrl.data import read_latents
        from flowrl.images import open_upright

        if stop is not None:
            stop()
        if self.shape is None:
            self.shape = tuple(self.policy.latent_shape())
        files = [meta[_side(i)] for i, meta in enumerate(metadata)]
        latents: list[torch.Tensor | None] = [None] * len(files)
        images = []
        for i, path in enumerate(files):
            if _is_latents(path):
                latents[i] = read_latents(path)
                self._check_shape(latents[i].shape, path, f"prompt {prompts[i]!r}", _side(i))
            else:
                images.append(i)
        chunk = self.cfg.sample.rollout_batch_size or len(images) or 1
        for start in range(0, len(images), chunk):
            rows = images[start : start + chunk]
            pictures = [open_upright(files[i]) for i in rows]
            for i, x in zip(rows, self.policy.encode_images(pictures).float().cpu()):
                latents[i] = x
        return self.policy.given_batch(list(prompts), list(metadata), torch.stack(latents))

    def prepare(self, batch, adv, keep, *, epoch, process_index):
        """Each pair's chosen sample (row 2k) wins over its rejected one (row 2k + 1); the advantages are unused."""
        ForwardProcessObjective.prepare(self, batch, adv, keep, epoch=epoch, process_index=process_index)
        n = len(keep)
        partner = torch.full((n,), -1, dtype=torch.long)
        partner[0::2] = torch.arange(1, n, 2)
        self.partner, self.pairs = partner, n // 2
        return partner >= 0


def _is_latents(path: str) -> bool:
    from flowrl.data import LATENTS_SUFFIX

    return path.endswith(LATENTS_SUFFIX)
