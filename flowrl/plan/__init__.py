"""`flowrl plan CONFIG`: will this config fit on these GPUs? A memory estimate made before renting them.

    from flowrl.config import load_config
    from flowrl.plan import plan
    print(plan(load_config("configs/sd35m_pickscore.yaml"), gpus=8, gpu_memory_gib=80).render())

The models are built from their configuration files on the meta device (no weight is read or allocated), so
even a 20B denoiser plans in seconds on a laptop. Per GPU, in GiB, it reports:

- the weights of every component the pipeline keeps on the GPU (denoiser, text encoders, VAE; not an SD1.5's
  safety checker, which flowrl never loads) and of the reward models, in their dtypes;
- the trained parameters (LoRA: rank `lora.rank` on the family's `lora_targets`, float32 as flowrl makes them;
  full fine-tuning: the whole denoiser, in `model.dtype` as flowrl trains it), their gradients, the AdamW
  states (2 per parameter) and the EMA copy (`train.ema_decay`);
- the reference pass (`train.grpo.beta` > 0; for the other objectives their KL coefficients, always for DPO): LoRA runs
  the base model with the adapter off (no extra weights); full fine-tuning keeps a frozen copy of the denoiser;
  NFT's old policy and AWM's EMA policy (ema_kl_coef > 0) are a second adapter or a frozen copy;
- what the rollout leaves on the GPU for the update: the trajectory's latents and the prompt-encoding cache;
- the activations of one sample of the update (forward and backward of `train.steps_per_forward` steps,
  doubled by classifier-free guidance where the family batches it), with and without gradient
  checkpointing, estimated from the denoiser's layer shapes (see `activation_bytes`);
- the largest `train.micro_batch_size` that fits under three strategies: DDP (everything replicated), FSDP
  (the denoiser's weights, its trained parameters, gradients, optimizer and EMA sharded over the GPUs) and
  offload (text encoders, VAE and rewards off the GPU, optimizer states and EMA in CPU memory);
- the rollout's peak, without gradients: `sample.rollout_batch_size` images (0: the GPU's whole batch) through
  the denoiser, then the VAE decoder; for a causal LM, generate()'s KV cache and scores, then (with
  `text.old_log_probs=forward`, or a reference forward for `text.kl_in_reward`) the log-probs of the GPU's whole
  batch in one forward; and the largest batch the rollout fits.

Configurations come from (in this order): a tiny test model (`tiny-<family>`, built for real: it is tiny), a
local pipeline directory (model_index.json and each component's config.json; checked as `flowrl train` checks it
before it loads: its folders, the weights of `model.variant`), the JSON files shipped in
`flowrl/plan_configs/` for the hub models the presets use (written from their published config.json files),
or the hub itself through huggingface_hub (its cache, or a download unless HF_HUB_OFFLINE is set).

Every figure is an estimate. The activation model (`activation_bytes`) was calibrated against peaks measured
on a CPU (benchmarks/memory.py, with its live-tensor tracker) on mid-size random models (each family's
`plan_calibration` says which, with the numbers; `text.LM_CALIBRATION` a causal LM's); it leaves out the CUDA
context, kernel workspaces and allocator fragmentation, for which `RESERVE_GIB` and `RESERVE_FRACTION` of each GPU
are kept free.

What the planner knows of a model family, it asks the family: its denoiser's layout and activation factors
(`plan_layout`, `plan_calibration` in flowrl/families/), its LoRA targets, its conditioning images' tokens; of an
objective, its memory terms (`Objective.memory_terms`); of a reward, the models it keeps (`rewards.memory_spec`).
"""

from __future__ import annotations

import re

from .activations import (
    Activations,
    ActivationTerms,
    Layer,
    activation_bytes,
    activation_terms,
    denoiser_layers,
    lora_cast_bytes,
)
from .columns import Column, columns
from .declarations import GENERIC_LAYOUT, NOT_CALIBRATED, Calibration, Layout, StrategyTerms
from .image import denoiser_declarations, plan_image
from .models import (
    DTYPE_BYTES,
    GIB,
    SHIPPED_DIR,
    Component,
    PlanError,
    build_on_meta,
    causal_lm,
    config_reader,
    family_of,
    feature_components,
    inject_lora,
    lora_parameters,
    pipeline_components,
    reward_components,
    shipped_models,
)
from .report import (
    LOGITS_PHASE,
    RESERVE_FRACTION,
    RESERVE_GIB,
    Fit,
    Plan,
    RolloutEstimate,
    Row,
    UpdateEstimate,
    usable_gib,
)
from .shapes import VAE_DECODE_FACTOR, ImageShape, image_shape, latent_frames, vae_decode_bytes
from .text import LM_BLOCKS, LM_CALIBRATION, lm_layers, plan_text


def plan(cfg, *, gpus: int = 1, gpu_memory_gib: float = 80.0) -> Plan:
    """The memory plan of `cfg` (a flowrl Config) on `gpus` GPUs of `gpu_memory_gib` GiB each: the models are
    built on the meta device from their configuration files (see the module docstring); nothing is loaded."""
    if gpus < 1:
        raise PlanError(f"gpus must be >= 1, got {gpus}")
    if not gpu_memory_gib > 0:
        raise PlanError(f"gpu_memory_gib must be > 0, got {gpu_memory_gib}")
    if cfg.backend == "text":
        return plan_text(cfg, gpus, gpu_memory_gib)
    return plan_image(cfg, gpus, gpu_memory_gib)


# ------------------------------------------------------------------------------------ the command line


def parse_memory(text: str) -> float:
    """GiB from "80GiB", "80 GiB", "80G", "80" (GiB), "85.9GB" (10^9 bytes), "81920MiB"."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    units = {
        "": 1.0,
        "g": 1.0,
        "gib": 1.0,
        "gb": 1e9 / GIB,
        "m": 1 / 1024,
        "mib": 1 / 1024,
        "mb": 1e6 / GIB,
        "t": 1024.0,
        "tib": 1024.0,
        "tb": 1e12 / GIB,
    }
    signed = re.fullmatch(r"\s*-\s*[0-9.]+\s*[a-zA-Z]*\s*", str(text))
    if signed or (m and m.group(2).lower() in units and float(m.group(1)) == 0):
        raise PlanError(f"--gpu-memory {text!r}: a GPU's memory must be positive, e.g. 80GiB, 80GB, 24 or 40960MiB")
    if not m or m.group(2).lower() not in units:
        raise PlanError(
            f"--gpu-memory {text!r}: give a size such as 80GiB, 80GB, 24 (GiB) or 40960MiB (units: GiB, GB, MiB, "
            "MB, TiB, TB)"
        )
    gib = float(m.group(1)) * units[m.group(2).lower()]
    if usable_gib(gib) <= 0:
        raise PlanError(
            f"--gpu-memory {text!r} ({gib:.3g} GiB) leaves nothing usable: the plan keeps {RESERVE_GIB:g} GiB and "
            f"{RESERVE_FRACTION:.0%} of each GPU for the CUDA context and the allocator; give the GPU's whole memory"
        )
    return gib


def main(config: str | None, overrides: list[str] | None = None, *, gpus: int = 1, gpu_memory: str = "80GiB") -> int:
    """`flowrl plan CONFIG [key=value ...] [--gpus N] [--gpu-memory 80GiB]`: print the plan; 0 if the config as it
    is (its update and its rollout) fits under one of the columns, 1 if it fits under none."""
    from flowrl.config import load_config
    from flowrl.preflight import check_rewards

    cfg = load_config(config, overrides or [])
    check_rewards(cfg)  # a config that cannot run is not planned (cheap: nothing is built)
    result = plan(cfg, gpus=gpus, gpu_memory_gib=parse_memory(gpu_memory))
    print(result.render())
    return 0 if any(result.fits_as_configured(s) for s in result.titles) else 1


__all__ = [
    "DTYPE_BYTES",
    "GENERIC_LAYOUT",
    "GIB",
    "LM_BLOCKS",
    "LM_CALIBRATION",
    "LOGITS_PHASE",
    "NOT_CALIBRATED",
    "RESERVE_FRACTION",
    "RESERVE_GIB",
    "SHIPPED_DIR",
    "VAE_DECODE_FACTOR",
    "ActivationTerms",
    "Activations",
    "Calibration",
    "Column",
    "Component",
    "Fit",
    "ImageShape",
    "Layer",
    "Layout",
    "Plan",
    "PlanError",
    "RolloutEstimate",
    "Row",
    "StrategyTerms",
    "UpdateEstimate",
    "activation_bytes",
    "activation_terms",
    "build_on_meta",
    "causal_lm",
    "columns",
    "config_reader",
    "denoiser_declarations",
    "denoiser_layers",
    "family_of",
    "feature_components",
    "image_shape",
    "inject_lora",
    "latent_frames",
    "lm_layers",
    "lora_cast_bytes",
    "lora_parameters",
    "main",
    "parse_memory",
    "pipeline_components",
    "plan",
    "reward_components",
    "shipped_models",
    "usable_gib",
    "vae_decode_bytes",
]
