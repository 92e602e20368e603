"""What the flow-matching families share: the scheduler's sigmas, flow_sde_step (sde, cps, dance, ode), the VAE's
scale and shift."""

from __future__ import annotations

import torch
from torch import Tensor

from flowrl.sampling import flow_sde_step

from ._base import ImageBackend, ImageModelError, Schedule


def flow_euler_scheduler(scheduler, family: str):
    """The FlowMatchEulerDiscreteScheduler a flow family samples with (the SDE kernels step on Euler sigmas), made
    from the directory's scheduler: itself if it is one; another flow-matching scheduler (FlowMatchHeun,
    FlowMatchLCM) through its config; a solver of flow predictions (DPM-Solver, UniPC: what SANA and Wan ship) with
    its flow shift. Anything else is an ImageModelError."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    config, name = scheduler.config, type(scheduler).__name__
    if name.startswith("FlowMatch"):
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    if config.get("prediction_type") == "flow_prediction":
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=config.get("num_train_timesteps", 1000), shift=config.get("flow_shift") or 1.0
        )
    raise ImageModelError(
        f"{family} samples flow-matching models; this {name} has prediction_type "
        f"{config.get('prediction_type')!r}, not 'flow_prediction' (a FlowMatchEulerDiscreteScheduler is right)"
    )


class FlowMatchingBackend(ImageBackend):
    """A flow-matching family: FlowMatchEulerDiscreteScheduler sigmas, flow_sde_step. The pipeline's scheduler is
    replaced by one made from it (`flow_euler_scheduler`) if it is another."""

    sde_types = ("sde", "cps", "dance", "ode")
    default_sde_type = "sde"
    other_schedulers = (
        ("FlowMatchHeunDiscreteScheduler", {}),
        (
            "DPMSolverMultistepScheduler",
            {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0},
        ),
    )

    def __init__(self, pipe, **kwargs):
        pipe.scheduler = flow_euler_scheduler(pipe.scheduler, self.family)
        super().__init__(pipe, **kwargs)

    def _set_scheduler(self, num_steps: int, **kwargs) -> Schedule:
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(device=self.device, **kwargs)
        timesteps, sigmas = scheduler.timesteps.clone(), scheduler.sigmas.clone()
        if len(timesteps) != num_steps or len(sigmas) != num_steps + 1:
            raise RuntimeError(f"scheduler gave {len(timesteps)} timesteps for {num_steps} steps")
        return Schedule(timesteps=timesteps.float(), sigmas=sigmas.float())

    def _step(self, model_output, x, steps, schedule, settings, *, stochastic, prev_latents=None, generator=None):
        return flow_sde_step(
            model_output,
            x,
            schedule.sigmas[steps],
            schedule.sigmas[steps + 1],
            noise_level=settings.noise_level,
            sde_type=settings.sde_type if stochastic else "ode",
            prev_latents=prev_latents,
            generator=generator,
            logprob_reduce=settings.logprob_reduce,
        )

    def flow_times(self, traj) -> Tensor:
        """The flow time of step i is its sigma (the schedule's sigmas[:S])."""
        return traj.sigmas[:-1].float()

    def _flow_input(self, x0, noise, t):
        """x_t = (1 - t) x0 + t eps at the denoiser timestep num_train_timesteps x t (the scheduler's timesteps are
        its sigmas x num_train_timesteps, so a rollout step at sigma = t passes the same); `_predict`'s output is
        the velocity."""
        tc = t.view(-1, *([1] * (x0.ndim - 1)))
        timesteps = t * float(self.pipe.scheduler.config.num_train_timesteps)
        return t, (1 - tc) * x0 + tc * noise, timesteps, _identity

    def _scale_shift(self, latents: Tensor) -> Tensor:
        config = self.pipe.vae.config
        return latents / config.scaling_factor + (config.shift_factor or 0.0)

    def _unscale_shift(self, latents: Tensor) -> Tensor:
        """`_scale_shift`'s inverse: (z - shift_factor) x scaling_factor, as the pipelines encode images."""
        config = self.pipe.vae.config
        return (latents - (config.shift_factor or 0.0)) * config.scaling_factor


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
