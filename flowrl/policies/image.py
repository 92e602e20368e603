"""A diffusers text-to-image pipeline as the policy: rollouts through the family's SDE sampler, LoRA (or full
fine-tuning with a frozen reference copy), deterministic steps with the LoRA merged, eval grids."""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path

import torch
from torch import Tensor

from flowrl import core
from flowrl.policies.base import DTYPES, ImageBatch, ReferenceCache, UnitOutput, full_tensor, shard_blocks
from flowrl.seeding import derive_seed


def save_model_state(model, directory: Path, state: dict[str, Tensor], max_shard_size: str = "10GB") -> None:
    """`model.save_pretrained(directory)` with the weights `state` (whole tensors: gathered from FSDP's
    shards): its config, and safetensors files split as diffusers splits them (with their index)."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_config(directory)
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, directory / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))


class ImagePolicy:
    reward_kind = "image"
    aggregation = "token-mean"  # the mean over samples and trained steps, as Flow-GRPO / DDPO
    can_export = True
    sharded = False  # FSDP2 (see `shard`)
    entropy_coef = 0.0

    def __init__(self, cfg, device):
        from flowrl.families import load_image_backend

        self.cfg = cfg
        m, s = cfg.model, cfg.sample
        offload = cfg.train.offload  # the pipeline loads into CPU memory; only the denoiser goes to the device
        from flowrl.hub import loading_bars

        with loading_bars(cfg.log.progress):  # diffusers' and transformers' loading bars only with log.progress
            self.backend = load_image_backend(
                m.path,
                m.family,
                dtype=DTYPES[m.dtype],
                device="cpu" if offload else device,
                max_sequence_length=s.max_sequence_length,
                drop_t5=m.drop_t5,
                **({"variant": m.variant} if m.variant else {}),
            )
        if offload:
            self.backend.denoiser.to(device)
            self.backend.offload(device)
        self.family = self.backend.family
        self.backend.check_image_size(s.height, s.width)
        from flowrl.sampling.acceleration import check_supported, parse, usable

        self.accelerators = parse(cfg.rollout.acceleration)  # on around the training rollouts' sampling only
        check_supported(self.backend, self.accelerators)  # a family that cannot take one says so before sampling
        self.accelerators = usable(self.backend, self.accelerators)  # those that would slow this machine: off
        pipe = self.backend.pipe
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)
        den = self.backend.denoiser
        self.ref_copy = None
        self.shadows: dict[str, tuple[torch.nn.Module | None, dict[str, Tensor]]] = {}  # see `add_shadow`
        if cfg.lora.enabled:
            from peft import LoraConfig

            torch.manual_seed(derive_seed(cfg.train.seed, 0x10BA))
            lcfg = LoraConfig(
                r=cfg.lora.rank,
                lora_alpha=cfg.lora.alpha,
                lora_dropout=cfg.lora.dropout,
                init_lora_weights="gaussian",
                target_modules=cfg.lora.target_modules or list(self.backend.lora_targets),
            )
            den.add_adapter(lcfg)
            if cfg.lora.init_path:
                self.load_adapter(cfg.lora.init_path)
            for name, p in den.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()  # trained weights in float32 whatever the model dtype
                    p.requires_grad_(True)
        else:
            den.requires_grad_(True)  # a frozen reference copy, if the objective needs one: `ensure_reference`
        if cfg.train.gradient_checkpointing:
            if not getattr(den, "_supports_gradient_checkpointing", False):
                raise ValueError(
                    f"train.gradient_checkpointing: {type(den).__name__} does not support it in this "
                    "diffusers version; set train.gradient_checkpointing=false"
                )
            den.enable_gradient_checkpointing()  # diffusers recomputes the blocks when grad is enabled

    # ---------------------------------------------------------------------------- the stochastic sampler

    def stochastic_sampler(self) -> tuple[str, object]:
        """(kernel, flowrl.sampling.SDEWindow) of the stochastic rollout, from train.grpo's sde_type and window (GRPO's
        settings: only its rollout samples stochastically); a kernel the family cannot train is a ValueError."""
        from flowrl.sampling import SDEWindow

        g = self.cfg.train.grpo
        kernel = self.backend.default_sde_type if g.sde_type == "auto" else g.sde_type
        if kernel not in self.backend.sde_types or kernel == "ode":
            raise ValueError(
                f"train.grpo.sde_type={kernel!r} cannot train a {self.family} model; valid: "
                f"{[t for t in self.backend.sde_types if t != 'ode']}"
            )
        w = g.window
        window = (
            SDEWindow()
            if w.kind == "all"
            else SDEWindow(w.kind, start=w.start, size=w.size, stride=w.stride, every=w.every)
        )
        return kernel, window

    # ---------------------------------------------------------------------------- rewards' view

    @property
    def reward_state(self):
        """TRL's `trainer_state` for rewards that ask for it (the trainer keeps it current)."""
        if not hasattr(self, "_reward_state"):
            from rewards import RewardState

            self._reward_state = RewardState()
        return self._reward_state

    def pop_reward_logs(self) -> dict[str, float]:
        return {}  # image rewards are plain callables: they log through `last_components`

    def pop_reward_extra(self) -> dict[str, list]:
        return {}

    # ---------------------------------------------------------------------------- parameters

    def named_trainable_parameters(self):
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def module(self) -> torch.nn.Module:
        """The trained denoiser itself (inside the DDP wrapper or DeepSpeed engine `wrap_trained` may have put around
        it)."""
        den = self.backend.denoiser
        wrapped = isinstance(den, torch.nn.parallel.DistributedDataParallel) or type(den).__name__ == "DeepSpeedEngine"
        return den.module if wrapped else den

    def wrap_trained(self, prepare) -> None:
        """Put `prepare(denoiser)` (accelerate's DDP wrapper) where the backend calls the denoiser: forward passes
        then go through it, and backward passes average the gradients over the processes."""
        self.backend.denoiser = prepare(self.module)

    @property
    def trained_module(self) -> torch.nn.Module:
        """What the forward passes with grad run through (the DDP wrapper when there is one)."""
        return self.backend.denoiser

    def shard(self) -> None:
        """FSDP2 over the processes: torch's `fully_shard` on every block of the denoiser (its classes are the
        model's `_no_split_modules`), innermost first, then on the denoiser. Its parameters become DTensor shards;
        each block is gathered for its forward and its gradients reduce-scattered in the backward."""
        dtype = self.backend.dtype  # before the sharding: full fine-tuning's bf16 weights become float32 masters
        copies = [c for c, _ in self.shadows.values() if c is not None]
        for model in (self.module, self.ref_copy, *copies):  # full fine-tuning's frozen copies: sharded alike
            if model is not None:
                shard_blocks(model, offload=self.cfg.train.offload)
        self.backend.compute_dtype = dtype
        self.sharded = True

    def lora_state(self) -> dict[str, Tensor]:
        """The LoRA's weights (peft names) as whole tensors on the CPU: gathered from every process when sharded
        (a collective: every process calls it)."""
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.module)
        return {k: full_tensor(v).detach().cpu().contiguous() for k, v in state.items()}

    def export_state(self) -> dict[str, Tensor]:
        """What `export` writes, as whole tensors on the CPU, gathered from every process when sharded (a
        collective: every process calls it): the LoRA's weights, or the whole denoiser's state."""
        if self.cfg.lora.enabled:
            return self.lora_state()
        return {k: full_tensor(v).detach().cpu().contiguous() for k, v in self.module.state_dict().items()}

    def trainable_parameters(self):
        return [p for _, p in self.named_trainable_parameters()]

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: the base model (the adapter off), or the frozen copy."""
        if self.ref_copy is not None:
            live = self.backend.denoiser
            self.backend.denoiser = self.ref_copy
            try:
                yield
            finally:
                self.backend.denoiser = live
        else:
            # Switch the LoRA layers directly: diffusers' disable_adapters() re-checks the peft version on every
            # call (a metadata file parse), which cost ~5 ms per reference forward on small models.
            layers = self._lora_layers()
            for m in layers:
                m.enable_adapters(False)
            try:
                yield
            finally:
                for m in layers:
                    m.enable_adapters(True)

    @contextlib.contextmanager
    def merged_adapter(self):
        """The LoRA folded into its base weights, W + s B A: the same function with one matmul per adapted layer
        instead of three, for passes that need neither a gradient nor a log-prob (the rollout's deterministic
        steps, the eval). On exit each base weight is again the very tensor it was: nothing is subtracted back,
        so nothing drifts. Without a plain LoRA (no adapter, DoRA, dropout) it changes nothing."""
        from peft.tuners.lora.layer import Linear as LoraLinear

        layers = self._lora_layers() if self.cfg.lora.enabled and self.ref_copy is None and not self.sharded else []
        # plain LoRA layers, active (not inside `reference()`), and a pass without gradient; else as it is
        if (
            not layers
            or self.cfg.lora.dropout > 0
            or torch.is_grad_enabled()
            or not all(
                isinstance(m, LoraLinear)
                and not m.merged
                and not m.disable_adapters
                and not any(m.use_dora.values())
                and any(a in m.lora_A for a in m.active_adapters)
                for m in layers
            )
        ):
            yield
            return
        saved = []
        try:
            for m in layers:
                w = m.base_layer.weight
                delta = sum(m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A)
                saved.append((m, w.data))
                w.data = w.data + delta.to(w.dtype)
                m.enable_adapters(False)
            yield
        finally:
            for m, data in saved:
                m.base_layer.weight.data = data
                m.enable_adapters(True)

    def _lora_layers(self) -> list:
        den = self.module
        if getattr(self, "_lora_cache", (None,))[0] is not den:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self._lora_cache = (den, [m for m in den.modules() if isinstance(m, BaseTunerLayer)])
        return self._lora_cache[1]

    # ---------------------------------------------------------------------------- rollout

    def rollout(
        self,
        prompts: list[str],
        metadata: list[dict],
        *,
        epoch: int,
        generator,
        final_only: bool = False,
        stop=None,
        on_chunk=None,
    ) -> ImageBatch:
        """Roll out one image per entry of `prompts` (a group's prompt repeats). With same_noise_per_group the
        entries come in whole groups, and each group starts from one shared initial noise.
        final_only: what the forward-process objectives train on: deterministic ODE sampling (no log-prob
        bookkeeping, the policy's LoRA merged for every step) keeping only the final latents (traj.latents
        [B, 1, ...], traj.log_probs None); the images are decoded as usual.
        stop(): called before each call of sample.rollout_batch_size images; it raises to abandon the rollout.
        on_chunk(part): called with each call's images as an ImageBatch (their prompts and metadata, no group ids)
        as soon as the call returns, in order (rollout.overlap_rewards scores them while the next call samples)."""
        s, g = self.cfg.sample, self.cfg.train.grpo
        if final_only:
            return self._final_rollout(
                prompts, metadata, epoch=epoch, generator=generator, stop=stop, on_chunk=on_chunk
            )
        G = s.group_size if g.same_noise_per_group else 1
        kernel, window = self.stochastic_sampler()
        chunk = s.rollout_batch_size or len(prompts)  # images per rollout call (memory), whole groups with G > 1
        chunk = max(G, chunk - chunk % G)

        def call(start: int):
            return self.backend.rollout(
                prompts[start : start + chunk : G],
                group_size=G,
                num_steps=s.num_steps,
                images=self.condition_images(metadata[start : start + chunk : G]),
                guidance_scale=s.guidance_scale,
                noise_level=g.noise_level,
                sde_type=kernel,
                sde_window=window,
                epoch=epoch,
                same_noise_per_group=G > 1,
                generator=generator,
                height=s.height,
                width=s.width,
                num_frames=s.num_frames,
                record_means=g.step_weighting == "ratio_norm" or g.policy_loss == "dppo",
                deterministic_context=self.merged_adapter,
            )

        return self._in_calls(call, prompts, metadata, chunk, stop, on_chunk)

    def _in_calls(self, call, prompts: list[str], metadata: list[dict], chunk: int, stop, on_chunk) -> ImageBatch:
        """The batch sampled in rollout calls of `chunk` entries: `call(start)` -> the Trajectory of entries
        start..start+chunk, each under the accelerators (a step cache's state starts afresh with every call), with
        `stop()` before and `on_chunk(part)` after each (see `rollout`)."""
        from flowrl.sampling import Trajectory

        parts = []
        for start in range(0, len(prompts), chunk):
            if stop is not None:
                stop()
            with self.accelerated():
                parts.append(call(start))
            if on_chunk is not None:
                end = start + chunk
                part = parts[-1]
                on_chunk(
                    ImageBatch(
                        traj=part,
                        prompts=list(prompts[start:end]),
                        metadata=list(metadata[start:end]),
                        images=part.images,
                    )
                )
        traj = parts[0] if len(parts) == 1 else Trajectory.cat(parts)
        return ImageBatch(traj=traj, prompts=list(prompts), metadata=list(metadata), images=traj.images)

    def accelerated(self):
        """rollout.acceleration's accelerators on the denoiser for the body (a training rollout's sampling), off
        after it: the update, the reference pass and the evaluation run without them."""
        from flowrl.sampling.acceleration import accelerated

        return accelerated(self.backend, self.accelerators, self.cfg.sample.num_steps)

    def _final_rollout(
        self, prompts: list[str], metadata: list[dict], *, epoch: int, generator, stop=None, on_chunk=None
    ) -> ImageBatch:
        """`rollout(final_only=True)`: ODE samples with sample.guidance_scale, only their final latents kept."""
        s = self.cfg.sample
        chunk = s.rollout_batch_size or len(prompts)

        def call(start: int):
            return self.backend.rollout(
                prompts[start : start + chunk],
                group_size=1,
                num_steps=s.num_steps,
                images=self.condition_images(metadata[start : start + chunk]),
                guidance_scale=s.guidance_scale,
                sde_type="ode",
                epoch=epoch,
                generator=generator,
                height=s.height,
                width=s.width,
                num_frames=s.num_frames,
                keep_steps=False,
                deterministic_context=self.merged_adapter,
            )

        return self._in_calls(call, prompts, metadata, chunk, stop, on_chunk)

    def condition_images(self, metadata: list[dict]) -> list[list] | None:
        """The conditioning images of prompts with these metadata rows (their `data.image_column` paths, loaded and
        fitted to the model's size multiple), one list per row; None when the family takes none (the counts were
        checked before the model loaded; the backend checks them again)."""
        from flowrl.conditioning import load_images

        column = self.cfg.data.image_column
        if self.backend.condition_images[1] == 0 and not any(column and column in m for m in metadata):
            return None
        multiple = self.backend.size_multiple
        return [load_images(m.get(column) if column else None, multiple) for m in metadata]

    # ---------------------------------------------------------------------------- the forward process

    def flow_times(self, batch: ImageBatch) -> Tensor:
        """[S] float32 on the CPU: the flow time of each step of the batch's rollout schedule (1 = noise)."""
        return self.backend.flow_times(batch.traj).float().cpu()

    def flow_prediction(
        self, batch: ImageBatch, rows: Tensor, t: Tensor, noise: Tensor, guidance_scale: float | None = None
    ):
        """The policy (whatever is active: trained, `reference()`, `shadow(...)`) at the clean samples `rows` [N]
        of the batch re-noised with `noise` [N, ...] at flow times `t` [N], without CFG (or guided with
        `guidance_scale`): a FlowPrediction (velocity, target, x_t, t) in float32, with grad when grad is enabled
        (`ImageBackend.flow_prediction`)."""
        traj = batch.traj
        x0 = traj.final_latents[rows.to(traj.latents.device)]
        prompt_ids = traj.prompt_ids[rows.to(traj.prompt_ids.device)]
        conditions = {name: c[rows.to(c.device)] for name, c in traj.conditions.items()}
        return self.backend.flow_prediction(
            x0, noise, t, prompt_ids, traj.prompt_encodings, traj.sampler, conditions, guidance_scale=guidance_scale
        )

    def sample_shape(self, batch: ImageBatch) -> tuple[int, ...]:
        """The shape of one clean sample (the denoiser's latent layout), e.g. [C, h, w] or FLUX's packed [L, C]."""
        return tuple(batch.traj.final_latents.shape[1:])

    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one clean sample of this run's size and frames (what `sample_shape` of its batches is)."""
        s = self.cfg.sample
        return self.backend.latent_shape(s.height, s.width, s.num_frames)

    def encode_images(self, images: list) -> Tensor:
        """PIL images of this run's size -> their clean latents [B, ...] where a rollout's final latents live
        (`ImageBackend.encode_images`)."""
        s = self.cfg.sample
        return self.backend.encode_images(images, height=s.height, width=s.width)

    def given_batch(self, prompts: list[str], metadata: list[dict], final_latents: Tensor, images=None) -> ImageBatch:
        """A batch of given clean samples `final_latents` [B, ...] of `prompts`, nothing sampled: as a
        `rollout(final_only=True)` with this run's schedule, guidance and conditioning images would record them
        (`ImageBackend.final_trajectory`); `images`: the samples as images, if any. Offline DPO trains on it."""
        s = self.cfg.sample
        traj = self.backend.final_trajectory(
            prompts,
            final_latents,
            num_steps=s.num_steps,
            guidance_scale=s.guidance_scale,
            height=s.height,
            width=s.width,
            num_frames=s.num_frames,
            images=self.condition_images(metadata),
        )
        traj.images = images
        return ImageBatch(traj=traj, prompts=list(prompts), metadata=list(metadata), images=images)

    def ensure_reference(self) -> None:
        """The reference policy for an objective that needs one: a LoRA's is the adapter off; full fine-tuning keeps a
        frozen copy of the starting denoiser (made at the first call). Before wrapping or sharding."""
        if not self.cfg.lora.enabled and self.ref_copy is None:
            self.ref_copy = copy.deepcopy(self.module).requires_grad_(False).eval()

    # ---------------------------------------------------------------------------- shadow policies

    def add_shadow(self, name: str) -> None:
        """A second set of the trained weights that forward passes can run instead (`shadow(name)`), never trained,
        moved only by the objective (core.soft_update_): DiffusionNFT's sampling policy ("old"), AWM's EMA policy.
        With a LoRA, a second peft adapter `name` in every adapted layer (float32); in full fine-tuning, a frozen
        copy of the denoiser. It starts as a copy of the trained weights. Call it before the trained model is wrapped
        (DDP) or sharded (FSDP), which then take it in as they take the rest."""
        if name in self.shadows or name == "default":
            raise ValueError(f"a shadow policy {name!r} exists already (or is the trained adapter's name)")
        trained = self.named_trainable_parameters()
        den = self.module
        if self.cfg.lora.enabled:
            with torch.random.fork_rng(), warnings.catch_warnings():  # its random init is overwritten: RNG untouched
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # a second adapter, yes
                den.add_adapter(copy.deepcopy(den.peft_config["default"]), adapter_name=name)
            for m in self._lora_layers():  # add_adapter made the new one active: the trained one is, alone with grad
                m.set_adapter("default")
            params = dict(den.named_parameters())
            missing = [n for n, _ in trained if n.replace(".default.", f".{name}.") not in params]
            if missing:
                raise RuntimeError(f"shadow adapter {name!r} lacks the copies of {missing[:2]}")
            weights = {n: params[n.replace(".default.", f".{name}.")] for n, _ in trained}
            module = None
        else:
            module = copy.deepcopy(den).requires_grad_(False).eval()
            params = dict(module.named_parameters())
            weights = {n: params[n] for n, _ in trained}
        with torch.no_grad():
            for n, p in trained:
                weights[n].data = p.detach().to(torch.float32 if self.cfg.lora.enabled else p.dtype, copy=True)
                weights[n].requires_grad_(False)
        self.shadows[name] = (module, weights)

    def shadow_parameters(self, name: str) -> dict[str, Tensor]:
        """Shadow `name`'s weights by the name of the trained parameter each copies (named_trainable_parameters')."""
        if name not in self.shadows:
            raise KeyError(f"no shadow policy {name!r}; have {sorted(self.shadows)}")
        return self.shadows[name][1]

    @contextlib.contextmanager
    def shadow(self, name: str):
        """Shadow policy `name` in place of the trained one for the forward passes of the block (no gradient to it)."""
        module, _ = self.shadows[name]
        if module is not None:
            live = self.backend.denoiser
            self.backend.denoiser = module
            try:
                yield
            finally:
                self.backend.denoiser = live
            return
        layers = self._lora_layers()
        for m in layers:
            m.set_adapter(name, inference_mode=True)
        try:
            yield
        finally:
            for m in layers:
                m.set_adapter("default")

    @staticmethod
    def call_reward(fn, batch: ImageBatch, columns: dict) -> Tensor:
        out = fn(batch.images, batch.prompts, **columns)
        out = torch.as_tensor(out, dtype=torch.float32).reshape(-1).cpu()
        if out.numel() != len(batch.prompts):
            raise ValueError(
                f"reward {getattr(fn, '__name__', fn)!r} returned {out.numel()} scores for {len(batch.prompts)} images"
            )
        return out

    # ---------------------------------------------------------------------------- training

    def train_units(self, batch: ImageBatch, steps_per_forward: int) -> list[list[int]]:
        steps = batch.traj.train_steps
        if not steps:
            raise ValueError("the rollout has no stochastic step to train (check train.grpo.window)")
        return [steps[i : i + steps_per_forward] for i in range(0, len(steps), steps_per_forward)]

    def _step_weights(self, traj, unit: list[int]) -> Tensor | None:
        kind = self.cfg.train.grpo.step_weighting
        if kind == "none":
            return None
        steps = traj.train_steps
        if kind == "noise":
            w = core.noise_step_weights(traj.stds[steps].float().cpu())
        else:  # ratio_norm: GRPO-Guard's 1/|dt| re-weighting
            sig = traj.sigmas.float().cpu()
            w = core.inverse_dt_step_weights(sig[[i + 1 for i in steps]] - sig[steps])
        pos = {s: i for i, s in enumerate(steps)}
        return w[[pos[u] for u in unit]].to(traj.latents.device)[None, :]  # [1, K]

    @staticmethod
    def _density_std(traj, std: Tensor) -> Tensor | None:
        """The std of the Gaussian whose log-density the kernel trains with, when it is not the transition's: CPS's
        unnormalised -(x' - mean)^2 is N(mean, 1/2)'s, so its KL is the mean squared difference of the means (its
        transition std, sigma_next sin(a pi / 2), is 0 at the last step, where a KL over it would be infinite).
        None: the transition's own."""
        return torch.full_like(std, 0.5**0.5) if traj.sampler.sde_type == "cps" else None

    def _kl_std(self, traj, unit: list[int], std: Tensor) -> Tensor:
        """The std the Gaussian KL divides by: the transition's (`step`), or Flow-GRPO's convention that
        leaves sqrt(dt) out (`sigma`): std / sqrt(sigma_t - sigma_{t+1}); a kernel that trains with another
        density than its transition's (CPS) takes that density's (`_density_std`), either way."""
        own = self._density_std(traj, std)
        if own is not None:
            return own
        if self.cfg.train.grpo.kl_std == "step" or traj.sigmas is None:
            return std
        sig = traj.sigmas.to(std.device).float()
        dt = (sig[unit] - sig[[u + 1 for u in unit]]).view(1, len(unit), *([1] * (std.ndim - 2)))
        return std / dt.sqrt()

    def step_mask(self, batch: ImageBatch, idx: Tensor, unit: list[int]) -> Tensor:
        return torch.ones(len(idx), len(unit))  # every trained denoising step counts

    def unit_log_probs(
        self,
        batch: ImageBatch,
        idx: Tensor,
        unit: list[int],
        *,
        with_reference: bool,
        reference_cache: ReferenceCache | None = None,
    ) -> UnitOutput:
        traj = batch.traj
        lp, mean, std = self.backend.step_log_prob(traj, unit, sample_indices=idx)  # [b,K] [b,K,...]
        dev = traj.log_probs.device
        old = traj.log_probs[idx.to(dev)][:, unit].to(lp.device)  # [b, K]
        out = UnitOutput(log_prob=lp, old_log_prob=old, mask=torch.ones_like(lp), weight=self._step_weights(traj, unit))
        if self.cfg.train.grpo.step_weighting == "ratio_norm":
            old_mean = traj.means[idx.to(traj.means.device)][:, unit].to(mean.device)
            out.log_ratio = core.ratio_norm_log_ratio(lp, old, mean, old_mean, std)
        elif self.cfg.train.grpo.policy_loss == "dppo":  # Flow-DPPO: each step's KL to the sampling policy
            old_mean = traj.means[idx.to(traj.means.device)][:, unit].to(mean.device)
            b, k = lp.shape
            dstd = self._density_std(traj, std)
            dstd = std.detach() if dstd is None else dstd
            out.step_kl = core.gaussian_kl(
                mean.detach().flatten(0, 1), old_mean.flatten(0, 1), dstd.flatten(0, 1).reshape(b * k)
            ).view(b, k)
        if with_reference:

            def reference_means() -> Tensor:  # [b*K, ...], sample-major
                with torch.no_grad(), self.reference():
                    return self.backend.step_log_prob(traj, unit, sample_indices=idx)[1].flatten(0, 1)

            if reference_cache is None:
                ref_mean = reference_means()
            else:  # a step's mean at a recorded latent: the same input in every pass
                ref_mean = reference_cache.rows([(i, s) for i in idx.tolist() for s in unit], reference_means)
            kstd = self._kl_std(traj, unit, std)
            b, k = lp.shape
            out.kl = core.gaussian_kl(mean.flatten(0, 1), ref_mean, kstd.flatten(0, 1).reshape(b * k)).view(b, k)
        return out

    def reward_penalty(self, batch: ImageBatch) -> Tensor | None:
        return None  # the image KL lives in the loss

    def describe_outputs(self, batch: ImageBatch) -> list[str] | None:
        return None  # images are shown as grids, not in the completions table

    # ---------------------------------------------------------------------------- eval / export

    def _eval_prompts_per_call(self, count: int, n: int, per_call: int) -> int:
        """The prompts of each of an eval's model calls (`evaluate_prompts`): `per_call` images (0: sample.
        rollout_batch_size, and 0 there: all `count` prompts in one call) of `n` per prompt, whole prompts."""
        per_call = per_call or self.cfg.sample.rollout_batch_size
        return max(1, per_call // n) if per_call else count

    def encode_as_eval(self, prompts, eval_cfg, part: slice | None = None, *, per_call=0) -> None:
        """The text encodings an eval of `prompts[part]` (`evaluate_prompts`, same arguments) makes, in the same
        calls, without sampling: a run that reads its eval before training from eval.base_cache leaves the prompt
        encodings' cache as the eval would have (an eval prompt that is a training prompt too then trains with the
        encoding the eval made of it, bit for bit: an encoding's last bits depend on the batch it was made in)."""
        mine = prompts[part or slice(0, len(prompts))]
        per = self._eval_prompts_per_call(len(mine), eval_cfg.images_per_prompt, per_call)
        for i in range(0, len(mine), per):
            self.backend.encode_prompts(mine[i : i + per])

    @torch.no_grad()
    def evaluate_prompts(
        self,
        prompts,
        metadata,
        reward_fns,
        eval_cfg,
        part: slice | None = None,
        stop=None,
        *,
        per_call=0,
        on_batch=None,
    ):
        """ODE samples of `prompts[part]` (`eval_cfg.images_per_prompt` each, prompt-major) and their scores:
        (images, per-reward scores [n] each, {reward/component: [n]}). Image j of the whole list starts from the
        j-th initial noise drawn from `eval_cfg.seed`, whatever `part` is: sharing the prompts out over processes
        (or sampling them in calls of `per_call` images, whole prompts: 0 takes sample.rollout_batch_size, and
        0 there the whole share in one call) gives every image the noise it has in one call. `stop()`: called
        before each batch and each reward; it raises to abandon the eval. `on_batch(k)`: called after each call
        with its k images."""
        s = self.cfg.sample
        n = eval_cfg.images_per_prompt
        part = part or slice(0, len(prompts))
        mine, mine_meta = prompts[part], metadata[part]
        if not mine:
            return [], [torch.zeros(0) for _ in reward_fns], {}
        per = self._eval_prompts_per_call(len(mine), n, per_call)
        noise = None
        if (part.start, part.stop) != (0, len(prompts)) or per < len(mine):  # the whole list's noise, then rows
            noise = self._noise(len(prompts) * n, eval_cfg.seed, eval_cfg.guidance_scale)[part.start * n :]
        images = []
        for i in range(0, len(mine), per):
            if stop is not None:
                stop()
            traj = self.backend.rollout(
                mine[i : i + per],
                group_size=n,
                num_steps=eval_cfg.num_steps,
                images=self.condition_images(mine_meta[i : i + per]),
                guidance_scale=eval_cfg.guidance_scale,
                sde_type="ode",
                seed=eval_cfg.seed if noise is None else None,
                latents=None if noise is None else noise[i * n : (i + len(mine[i : i + per])) * n],
                height=s.height,
                width=s.width,
                num_frames=s.num_frames,
                deterministic_context=self.merged_adapter,
            )
            images.extend(traj.images)
            if on_batch is not None:
                on_batch(len(traj.images))
        rep_prompts = [p for p in mine for _ in range(n)]
        rep_meta = [m for m in mine_meta for _ in range(n)]
        batch = ImageBatch(traj=None, prompts=rep_prompts, metadata=rep_meta, images=images)
        columns = {k: [m.get(k) for m in rep_meta] for k in {k for m in rep_meta for k in m}}
        per_reward, comps = [], {}
        for spec, fn in zip(self.cfg.rewards, reward_fns):
            if stop is not None:
                stop()
            per_reward.append(self.call_reward(fn, batch, columns))
            for name, v in (getattr(fn, "last_components", None) or {}).items():
                comps[f"{spec.name}/{name}"] = torch.as_tensor(v, dtype=torch.float32)
        return images, per_reward, comps

    def _noise(self, n: int, seed: int, guidance_scale: float) -> Tensor:
        """n initial noises drawn from `seed` on the CPU, as a rollout with that seed draws them."""
        from flowrl.sampling import SamplerSettings

        s = self.cfg.sample
        h, w = self.backend.check_image_size(s.height, s.width)
        settings = SamplerSettings(
            family=self.family,
            sde_type="ode",
            noise_level=0.0,
            guidance_scale=guidance_scale,
            logprob_reduce="mean",
            height=h,
            width=w,
            num_frames=self.backend.check_num_frames(s.num_frames),
        )
        return self.backend._initial_noise(n, settings, torch.Generator(device="cpu").manual_seed(seed))

    @torch.no_grad()
    def sample(
        self,
        prompts: list[str],
        seeds: list[int],
        *,
        num_steps: int,
        guidance_scale: float,
        image_paths: list[str] | None = None,
    ) -> list:
        """ODE images, prompt-major: for each prompt one image per seed, image (prompt, seed) starting from the noise
        that seed draws, so it is the same whatever is sampled beside it. image_paths: the conditioning images of
        every prompt (a family that takes them: the source image of an edit, the first frame of a video)."""
        from flowrl.conditioning import load_images

        noise = torch.cat([self._noise(1, seed, guidance_scale) for _ in prompts for seed in seeds])
        s = self.cfg.sample
        images = None
        if image_paths or self.backend.condition_images[1]:
            images = [load_images(list(image_paths or []), self.backend.size_multiple) for _ in prompts]
        traj = self.backend.rollout(
            prompts,
            group_size=len(seeds),
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            sde_type="ode",
            latents=noise,
            height=s.height,
            width=s.width,
            images=images,
            num_frames=s.num_frames,
            deterministic_context=self.merged_adapter,
        )
        return traj.images

    def save_eval_outputs(self, images, prompts, path: Path, scores=None) -> Path:
        """`path`.png: the eval images in a grid, each row captioned with its prompt and each image with its score
        (`scores`: one number per image, or None). Videos: the grid holds each one's contact sheet (first, middle
        and last frames), and the videos themselves go to the folder `path`/ as `NNN.webp` (eval.video_format)."""
        from flowrl.images import eval_grid
        from flowrl.video import is_video

        grid = eval_grid(images, prompts, None if scores is None else [float(x) for x in scores])
        path = Path(str(path) + ".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.png")
        grid.save(tmp)
        tmp.replace(path)
        if images and is_video(images[0]):
            for i, video in enumerate(images):
                self.save_sample(video, path.with_suffix("") / f"{i:03d}")
        return path

    def save_sample(self, sample, stem: Path) -> Path:
        """One sample at `stem` + its suffix: an image as .png, a video as an animation in eval.video_format at
        eval.fps (MP4 needs imageio[ffmpeg]: without it WebP, with a warning). Returns the file written."""
        from flowrl.video import animation_suffix, is_video, save_animation

        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        if not is_video(sample):
            path = stem.with_name(stem.name + ".png")
            tmp = stem.with_name(stem.name + ".tmp.png")
            sample.save(tmp)  # then renamed: an interrupted write leaves no half image under the name
            tmp.replace(path)
            return path
        wanted = "." + self.cfg.eval.video_format
        suffix = animation_suffix(wanted)
        if suffix != wanted and not getattr(self, "_warned_mp4", False):
            self._warned_mp4 = True
            warnings.warn(
                "eval.video_format=mp4 needs imageio[ffmpeg] (pip install 'imageio[ffmpeg]'); writing "
                "animated WebP instead",
                stacklevel=2,
            )
        return save_animation(sample, stem.with_name(stem.name + suffix), fps=self.cfg.eval.fps)

    def export(self, directory: Path, state: dict[str, Tensor] | None = None) -> None:
        """The trained weights in the format diffusers loads: the LoRA for `pipe.load_lora_weights(dir)`,
        or the full denoiser as `save_pretrained` writes it (`from_pretrained(dir / "transformer")`). `state`:
        the weights already gathered (`export_state()`, which a sharded policy needs every process to call)."""
        den = self.module
        directory = Path(directory)
        if not self.cfg.lora.enabled:
            if state is None:
                den.save_pretrained(directory / self.backend.denoiser_attr)
            else:
                save_model_state(den, directory / self.backend.denoiser_attr, state)
            return
        state = state if state is not None else self.lora_state()
        # the adapter's config (rank, alpha, targets) travels with the weights, so alpha / r is restored
        metadata = den.peft_config["default"].to_dict()
        # peft keeps target_modules as a set, whose order changes with every process's hash seed: sorted, the same
        # weights give the same file
        metadata = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in metadata.items()}
        if isinstance(metadata.get("target_modules"), list):
            metadata["target_modules"] = sorted(metadata["target_modules"])
        self.backend.export_lora(type(self.backend.pipe), directory, state, metadata)

    def load_adapter(self, init_path: str) -> None:
        """Start the adapter from the LoRA of `init_path` (lora.init_path: a directory holding its .safetensors file,
        or that file; diffusers' format, `flowrl.lora_files`). A LoRA of another rank, alpha or other modules than
        this adapter's is a ConfigError naming the file's setting against the config's."""
        from peft.utils import set_peft_model_state_dict

        from flowrl.lora_files import init_state
        from flowrl.preflight import lora_init_file

        path, _ = lora_init_file(init_path)
        own = {k: tuple(v.shape) for k, v in self.lora_state().items()}
        state = init_state(path, self.cfg.lora, own, self.backend.denoiser_attr)
        set_peft_model_state_dict(self.module, state)
