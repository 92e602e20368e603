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
from .crd import CRD_LOSSES, crd_decay, crd_implicit_reward, crd_loss, group_centred, group_mean, group_softmax
from .dgpo import dgpo_loss, dsm_clip_mask, dsm_error, group_preference_weights
from .elbo import ELBO_LOSSES, ELBO_WEIGHTINGS, elbo_estimate, elbo_loss
from .kl import KL_KINDS, gaussian_kl, kl_estimate
from .logprobs import entropy_from_logits, sample_categorical, token_log_probs
from .losses import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    clipped_surrogate,
    dppo_loss,
    get_policy_loss,
    gspo_loss,
    loss_normalizer,
    loss_numerator,
    ppo_clip_loss,
    sequence_log_ratio,
)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .mismatch import IS_LEVELS, mismatch_metrics, truncated_is_weights
from .objectives import (
    AWM_WEIGHTINGS,
    OBJECTIVE_LOSSES,
    attribute_shift,
    awm_loss,
    awm_matching_loss,
    best_worst_pairs,
    dpo_loss,
    forward_noising,
    get_objective_loss,
    matched_pairs,
    nft_loss,
    optimality_probability,
    ranked_pairs,
    soft_update_,
    soft_update_decay,
    stratified_times,
)
from .pairwise import clause_preferences, scalar_preferences, win_rates
from .registry import Registry, unknown_name_error
from .steps import STEP_WEIGHTINGS, inverse_dt_step_weights, noise_step_weights, ratio_norm_log_ratio

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IS_LEVELS",
    "AGGREGATION_MODES",
    "AWM_WEIGHTINGS",
    "ELBO_LOSSES",
    "ELBO_WEIGHTINGS",
    "KL_KINDS",
    "OBJECTIVE_LOSSES",
    "POLICY_LOSSES",
    "PerPromptStatTracker",
    "Registry",
    "STEP_WEIGHTINGS",
    "aggregate_loss",
    "awm_loss",
    "attribute_shift",
    "awm_matching_loss",
    "best_worst_pairs",
    "matched_pairs",
    "ranked_pairs",
    "stratified_times",
    "clause_preferences",
    "clipped_surrogate",
    "dpo_loss",
    "elbo_estimate",
    "elbo_loss",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "forward_noising",
    "gae_advantages",
    "gaussian_kl",
    "gdpo_advantages",
    "get_advantage_estimator",
    "get_objective_loss",
    "get_policy_loss",
    "group_advantages",
    "group_index",
    "dppo_loss",
    "gspo_loss",
    "inverse_dt_step_weights",
    "kl_estimate",
    "loss_normalizer",
    "loss_numerator",
    "masked_mean",
    "mismatch_metrics",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "nft_loss",
    "noise_step_weights",
    "optimality_probability",
    "ppo_clip_loss",
    "ratio_norm_log_ratio",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "scalar_preferences",
    "sample_categorical",
    "sequence_log_ratio",
    "soft_update_",
    "soft_update_decay",
    "token_log_probs",
    "truncated_is_weights",
    "win_rates",
    "unknown_name_error",
]
__all__ += [
    "CRD_LOSSES",
    "crd_decay",
    "crd_implicit_reward",
    "crd_loss",
    "group_centred",
    "group_mean",
    "group_softmax",
]
__all__ += ["dgpo_loss", "dsm_clip_mask", "dsm_error", "group_preference_weights"]
