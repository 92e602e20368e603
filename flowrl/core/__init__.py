"""The RL core shared by the image and text backends: pure torch, no diffusers or transformers.

A "step" is a denoising step (images) or a token (text); everything here sees `[N, S]` tensors of
log-probs, advantages and masks.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    PerPromptStatTracker,
    dr_grpo_advantages,
    gae_advantages,
    gdpo_advantages,
    get_advantage_estimator,
    group_advantages,
    group_index,
    reinforce_pp_advantages,
    rloo_advantages,
)
from .kl import KL_KINDS, gaussian_kl, kl_estimate
from .logprobs import entropy_from_logits, sample_categorical, token_log_probs
from .losses import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    clipped_surrogate,
    get_policy_loss,
    gspo_loss,
    loss_normalizer,
    loss_numerator,
    ppo_clip_loss,
    sequence_log_ratio,
)
from .objectives import (
    AWM_WEIGHTINGS,
    OBJECTIVE_LOSSES,
    awm_loss,
    awm_matching_loss,
    best_worst_pairs,
    dpo_loss,
    forward_noising,
    get_objective_loss,
    nft_loss,
    optimality_probability,
    soft_update_,
    soft_update_decay,
)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .registry import Registry, unknown_name_error
from .steps import STEP_WEIGHTINGS, inverse_dt_step_weights, noise_step_weights, ratio_norm_log_ratio

from types import ModuleType as _ModuleType

__all__ = [n for n, v in list(globals().items()) if not n.startswith("_") and not isinstance(v, _ModuleType)]
