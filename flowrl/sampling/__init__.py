"""Step kernels with log-probs (flow SDE / CPS / Dance / Euler, DDIM) and the rollout recorder.

Pure torch: nothing here imports diffusers. The families in `flowrl.families` drive the models.
"""

from flowrl.sampling.ddim import ddim_sigma, ddim_step, ddim_transition, ddpm_flow_time, ddpm_velocity
from flowrl.sampling.flow_sde import (
    DEFAULT_NOISE_LEVEL,
    FLOW_KERNELS,
    FlowKernel,
    cps_transition,
    dance_transition,
    euler_transition,
    flow_grpo_noise_scale,
    flow_grpo_transition,
    flow_sde_step,
)
from flowrl.sampling.rollout import Chain, SDEWindow, as_sde_window, record_chain
from flowrl.sampling.step import LOGPROB_REDUCTIONS, StepOutput, gaussian_log_density
from flowrl.sampling.trajectory import PromptEncodings, SamplerSettings, Trajectory

__all__ = [
    "Chain",
    "DEFAULT_NOISE_LEVEL",
    "FLOW_KERNELS",
    "FlowKernel",
    "LOGPROB_REDUCTIONS",
    "PromptEncodings",
    "SDEWindow",
    "SamplerSettings",
    "StepOutput",
    "Trajectory",
    "as_sde_window",
    "cps_transition",
    "dance_transition",
    "ddim_sigma",
    "ddim_step",
    "ddim_transition",
    "ddpm_flow_time",
    "ddpm_velocity",
    "euler_transition",
    "flow_grpo_noise_scale",
    "flow_grpo_transition",
    "flow_sde_step",
    "gaussian_log_density",
    "record_chain",
]
