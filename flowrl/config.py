"""The configuration: one dataclass tree, a docstring under each field, YAML presets, `key=value` overrides.

Every key is validated once, before any work starts: an unknown key is an error naming the closest
valid keys, a value of the wrong type or outside its choices names what would be right.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from .errors import FlowrlError


class ConfigError(FlowrlError, ValueError):
    """A config key or value that is not valid; the message says what would be."""

    exit_code = 2


# --------------------------------------------------------------------------------------------- tree


@dataclass
class ModelConfig:
    path: str = "tiny-sd3"
    """Hub id (e.g. `stabilityai/stable-diffusion-3.5-medium`), local directory, or `tiny-<family>` (`tiny-sd3`,
    `tiny-flux`, ...) for a tiny random-weight pipeline built in code (tests, smoke runs)."""
    family: str = "auto"
    """Pipeline family (a module of flowrl.families: sd3, flux, sd15, ...); `auto` detects it from the pipeline
    class."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the frozen weights and the forward pass (step math is float32 whatever this is)."""
    device: str = "auto"
    """`auto` (the accelerator's device), `cpu`, `cuda`, `cuda:1`, ..."""
    drop_t5: bool = False
    """SD3/SD3.5: leave the T5 text encoder out (diffusers' `text_encoder_3=None`): ~4.7B fewer parameters in
    memory, prompts encoded by the two CLIP encoders only (T5's part of the embedding is zeros)."""


@dataclass
class LoraConfig:
    enabled: bool = True
    """Train a LoRA adapter (peft); false = full fine-tuning of the denoiser (with a frozen reference copy)."""
    rank: int = 8
    """LoRA rank r."""
    alpha: float = 16.0
    """LoRA alpha (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """LoRA dropout."""
    target_modules: Optional[list[str]] = None
    """Module names to adapt; None = the family's default (attention projections, and FFN for SD3/FLUX)."""
    init_path: Optional[str] = None
    """Start from a saved adapter (a checkpoint's `lora/` dir) instead of a fresh one."""


@dataclass
class WindowConfig:
    kind: Literal["all", "fixed", "sliding"] = "all"
    """Which denoising steps are stochastic (SDE) and trained: `all`; a `fixed` window [start, start+size)
    (Flow-GRPO-Fast); a `sliding` window that moves with the epoch (MixGRPO). Steps outside are ODE."""
    start: int = 0
    """First step of the window (fixed) or of the slide (sliding)."""
    size: int = 0
    """Window length in steps (0 with kind=all)."""
    every: int = 1
    """sliding: move the window by `stride` steps every this many epochs."""
    stride: int = 1
    """sliding: steps the window moves per shift (it rolls back to `start` past the last step)."""


@dataclass
class SampleConfig:
    num_steps: int = 10
    """Denoising steps per rollout (Flow-GRPO trains on 10 and evaluates with 40)."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale during rollouts (FLUX: the distilled guidance embedding)."""
    noise_level: Optional[float] = None
    """SDE noise level: Flow-GRPO's `a` (sigma_t = a sqrt(sigma / (1 - sigma))), CPS's angle fraction,
    DanceGRPO's / DDIM's eta; null = the kernel's default (0.7, 0.7, 0.3, 1.0)."""
    sde_type: Literal["auto", "sde", "cps", "dance", "ddim"] = "auto"
    """Stochastic step kernel: Flow-GRPO `sde`, coefficients-preserving `cps`, DanceGRPO `dance`; `ddim`
    for epsilon-prediction UNets (SD1.5/SDXL); `auto` = the family's default (sde / ddim)."""
    window: WindowConfig = field(default_factory=WindowConfig)
    """Which steps are stochastic and trained."""
    same_noise_per_group: bool = False
    """One initial noise for every image of a group (the group then differs only by the SDE noise)."""
    height: int = 64
    """Image height in pixels (a multiple of the model's latent factor times its patch size)."""
    width: int = 64
    """Image width in pixels."""
    group_size: int = 4
    """Images per prompt (the GRPO group), >= 2."""
    prompts_per_epoch: int = 4
    """Distinct prompts per epoch (over all processes); the epoch's batch is prompts_per_epoch x group_size,
    split evenly over the processes (a group may span two)."""
    rollout_batch_size: int = 0
    """Images per rollout forward (0 = the whole epoch batch at once)."""
    max_sequence_length: int = 77
    """T5 tokens for SD3/FLUX prompts (tiny runs: 16-32)."""
    num_frames: int = 0
    """Video families: frames per video (Wan: 4k + 1); 0 = the family's default (81 for Wan, 1 for images)."""


@dataclass
class TextConfig:
    max_new_tokens: int = 16
    """Most tokens per completion (T)."""
    max_prompt_length: int = 256
    """Prompts are truncated (from the left) to this many tokens."""
    temperature: float = 1.0
    """Sampling temperature; the old and new log-probs are taken under it too."""
    old_log_probs: Literal["sampling", "forward"] = "sampling"
    """Where the rollout's (old) token log-probs come from: `sampling`, the logits of generate()'s own cached
    decoding steps (no second pass); `forward`, a separate forward over prompt + completion without a cache, as the
    update computes them (for models whose cached and uncached numerics differ: `policy/ratio_first` shows it).
    Both are log softmax(logits / temperature) over the whole vocabulary; top-k / top-p are left out of both."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one."""
    mask_truncated: bool = False
    """Leave completions that hit max_new_tokens without an EOS out of the loss (DAPO's overlong filtering)."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                      "seq-mean-token-sum-max-len"] = "token-mean"
    """How token losses become one number (see flowrl.core.aggregate_loss): `seq-mean-token-sum-norm` is verl's
    (the sum over every completion token / max_new_tokens), `seq-mean-token-sum-max-len` Dr.GRPO's 1/G form (the
    mean over completions of their token sums / max_new_tokens)."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    """KL estimator against the reference (Schulman's k1/k2/k3)."""
    kl_in_reward: bool = False
    """Put beta x sum_t KL_t into the reward (PPO-RLHF style) instead of the loss."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef x the aggregated token entropy."""
    loss_preset: Literal["none", "grpo", "dapo", "dr_grpo", "gspo"] = "none"
    """Published loss variants: sets the clip range, ratio level, aggregation, advantage scale and KL as the
    paper did (keys you set yourself win). See flowrl.config.LOSS_PRESETS."""


@dataclass
class NFTConfig:
    beta: float = 1.0
    """DiffusionNFT's beta: the implicit policies v+- = v_old +- beta (v_theta - v_old) (the reference: 1; 0.1 for OCR
    and its multi-reward run)."""
    adaptive_weight: bool = True
    """Weigh each squared error by its own detached mean absolute error in x0-space (the reference's default)."""
    adv_clip: float = 5.0
    """r = 1/2 + 1/2 clip(A / adv_clip, -1, 1), the optimality probability of a sample with advantage A (the
    reference: 5, its adv_clip_max; it normalises by the batch's std: train.adv_scale=batch)."""
    policy_scale: float = 5.0
    """The policy term's factor before the KL term is added (the reference multiplies it by its adv_clip_max, 5)."""
    kl_coef: float = 1e-4
    """Velocity-space penalty kl_coef ||v_theta - v_ref||^2 toward the reference (the adapter off; a frozen copy in
    full fine-tuning); 0 skips the reference's forward pass (the reference: 1e-4)."""
    decay_rate: float = 1e-3
    """After each epoch's update the old (sampling) policy moves toward the trained one: old <- lambda old +
    (1 - lambda) theta with lambda = min(decay_rate (step - decay_start), decay_cap), step = optimizer steps so far
    (the reference: 1e-3, cap 0.5, start 0; OCR: 7.5e-3, cap 0.999, start 75)."""
    decay_cap: float = 0.5
    """The largest lambda (see decay_rate)."""
    decay_start: int = 0
    """Optimizer steps before which lambda = 0 (the old policy is a copy of the trained one)."""
    timesteps: int = 0
    """Training times per sample: that many steps of the rollout's schedule, a random order per sample, each with
    fresh noise; 0 = int(0.99 x sample.num_steps) (the reference's timestep_fraction 0.99: 9 of its 10 steps)."""


@dataclass
class AWMConfig:
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """The weighting m(l, t) of a sample's flow-matching error l (core.awm_matching_loss; the reference: ghuber)."""
    ghuber_power: float = 0.25
    """p of the generalised Huber weighting t / p ((l + d)^p - d^p) (the reference: 0.25)."""
    advantage_clip: float = 5.0
    """Advantages are clipped to +- this, then divided by it (the reference: 5)."""
    kl_coef: float = 1e-3
    """Velocity-space penalty toward the reference (the adapter off; a frozen copy in full fine-tuning); 0 skips its
    forward pass (the reference: 1e-3 GenEval, 3e-3 OCR, 1e-4 PickScore)."""
    ema_kl_coef: float = 0.0
    """Penalty ||v_theta - v_ema||^2 toward an EMA of the policy (a second adapter, soft-updated after every
    optimizer step), one more forward pass per time; 0 = off (the reference's runs use 1)."""
    ema_decay_rate: float = 1e-3
    """The EMA policy's lambda = min(ema_decay_rate x step, ema_decay_cap) (the reference: 1e-3, 0.3)."""
    ema_decay_cap: float = 0.3
    """The EMA policy's largest lambda."""
    timesteps: int = 6
    """Training times per sample: one index per stratum of the rollout's steps [1, int(timestep_fraction x S))
    (the first step, pure noise, is left out), each with fresh noise, drawn per sample (the reference: 6 strata
    shared by its batch)."""
    timestep_fraction: float = 0.9
    """The share of the rollout's S steps the training times come from (the reference: 0.9)."""


@dataclass
class DPOConfig:
    beta: float = 5000.0
    """Diffusion-DPO's beta: the loss is -log sigmoid(-beta/2 w(t) D), D the winner's minus the loser's
    (model - reference) error difference. 5000 is the paper's (SD1.5 / SDXL) for noise errors, which the default
    weighting=noise reproduces for every family; with weighting=velocity divide it by about 3 (E[(1-t)^2] for
    uniform t) for the same strength."""
    weighting: Literal["noise", "velocity"] = "noise"
    """`noise`: w(t) = (1 - t)^2, which turns velocity errors into the paper's noise errors exactly (eps - eps_hat =
    (1 - t)(v - v_hat)); `velocity`: w = 1, Flow-DPO's form on velocity errors."""
    timesteps: int = 0
    """Training times per pair (the same time and noise for winner and loser): that many steps of the rollout's
    schedule in a random order per pair; 0 = all of them (an online batch has one pair per prompt; the paper draws
    one time per pair and step)."""


@dataclass
class TrainConfig:
    objective: Literal["grpo", "nft", "awm", "dpo"] = "grpo"
    """What the update optimises (flowrl.objectives): `grpo` = the policy loss on the sampler's own stochastic steps
    (Flow-GRPO / DDPO); on the forward (noising) process of ODE samples' clean latents, with the CFG-free model:
    `nft` = DiffusionNFT (train.nft), `awm` = Advantage Weighted Matching (train.awm), `dpo` = online Diffusion-DPO
    on each group's best and worst image (train.dpo). Those three are for backend=image and ignore GRPO's step keys
    (sample.window, sde_type, noise_level, step_weighting, the clip ranges, beta)."""
    epochs: int = 2
    """Epochs; one epoch = one rollout batch and `inner_epochs` passes of updates over it."""
    inner_epochs: int = 1
    """Passes over each rollout batch (mu); > 1 makes later passes off-policy (the ratio leaves 1)."""
    minibatch_size: int = 0
    """Samples per optimizer minibatch (0 = the whole batch); must divide the epoch batch."""
    steps_per_forward: int = 1
    """Trained denoising steps (another objective's training times) evaluated in one model call (stacked along the
    batch)."""
    micro_batch_size: int = 0
    """Samples per forward and backward pass (0 = the whole minibatch): the minibatch is split into micro-batches
    whose losses (with the minibatch's normalizer) add up to its loss, and takes one optimizer step. Memory of the
    update's activations scales with it; the gradient does not change."""
    sharding: Literal["none", "fsdp"] = "none"
    """With several processes: `none` = DDP (every process holds the whole model; the gradients are averaged);
    `fsdp` = FSDP2 (torch's fully_shard on every block and on the model: the denoiser's blocks, or a causal LM's
    decoder layers): its weights, the trained weights' gradients and optimizer states are sharded over the
    processes, each block gathered for its forward; full fine-tuning's frozen reference copy is sharded alike (a
    LoRA's reference is the adapter off); text generation runs with `synced_gpus`."""
    gradient_checkpointing: bool = False
    """Recompute the trained model's activations in the backward pass instead of keeping them (diffusers'
    enable_gradient_checkpointing for the denoiser, transformers' for a causal LM): less memory, ~30% more time,
    the same gradient."""
    offload: bool = False
    """Keep off the accelerator what the update does not use: the text encoders (on it only while prompts are
    encoded; encodings are cached), the VAE (only while it decodes) and the local reward models (only while they
    score); the optimizer's states, its float32 master weights and the EMA stay in CPU memory, the optimizer step
    running there (with train.sharding=fsdp: FSDP2's CPU offload of the sharded weights, gradients and states).
    Less accelerator memory for host memory and transfer time; off by default (tiny runs gain nothing)."""
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    """`adamw` = torch's AdamW with float32 states; `adamw_8bit` = bitsandbytes' AdamW8bit (block-wise 8-bit
    states: 2 bytes per trained parameter instead of 8; `pip install 'flowrl[bnb]'`). Trained weights that are
    not float32 (full fine-tuning in bf16/fp16) are stepped through float32 master copies either way."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up. Its position is the minibatch's place in the run (epoch, pass,
    minibatch), so a minibatch that takes no optimizer step does not delay it."""
    decay_frac: float = 1.0
    """Cosine only: the fraction of the run (after warm-up) over which the lr decays to 0, at its end; before
    that it stays at `lr` (warm-up-stable-decay). 1 = decay over the whole run."""
    schedule_over: Literal["epochs", "budget"] = "epochs"
    """What the cosine's "whole run" is: `epochs` = train.epochs; `budget` = whichever end comes first, the
    epochs or the time budget train.max_minutes (on train.budget_clock, counted as it is, across resumes):
    the position is the further along of the two, measured at each epoch's start (every process takes the
    largest), so a run that stops on its time budget ends with its lr decayed to 0. Needs train.max_minutes."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    policy_loss: str = "ppo_clip"
    """Policy loss from the core's registry (`ppo_clip`, `gspo`)."""
    clip_low: float = 1e-4
    """Lower clip range epsilon (ratio >= 1 - clip_low); Flow-GRPO uses 1e-4."""
    clip_high: Optional[float] = None
    """Upper clip range (None = clip_low; DAPO's clip-higher sets it larger)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    adv_estimator: str = "grpo"
    """Advantage estimator from the core's registry (`grpo`, `rloo`, `reinforce_pp`, `dr_grpo`)."""
    adv_scale: Literal["group", "batch", "none"] = "group"
    """GRPO std: per group, over the whole batch (Flow-GRPO's global std), or none (Dr.GRPO)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to +- this."""
    drop_zero_adv_groups: bool = False
    """Skip groups whose advantages are all zero (no signal): they leave the loss and its normaliser (DAPO's
    dynamic sampling without the resampling), and their forward and backward passes are not run at all. A
    minibatch left with no sample takes no optimizer step."""
    dropped_norm: Literal["kept", "minibatch"] = "kept"
    """With drop_zero_adv_groups, what the minibatch's loss is divided by: its kept samples (DAPO), or all its
    samples, the dropped ones counted as zero (the plain GRPO normaliser: the same gradient as not dropping,
    when beta = 0). With `minibatch` a minibatch with little signal takes a smaller step."""
    per_prompt_stats: bool = False
    """Normalise with DDPO's per-prompt stat tracker (history across epochs) instead of the batch's groups."""
    stat_buffer_size: int = 32
    """Per-prompt tracker: rewards kept per prompt."""
    stat_min_count: int = 16
    """Per-prompt tracker: below this many, the batch statistics are used."""
    reward_combine: Literal["sum", "gdpo"] = "sum"
    """Several rewards: weighted sum then one advantage (`sum`), or GDPO's per-reward group
    normalisation then weighted sum and batch whitening (`gdpo`)."""
    step_weighting: Literal["none", "noise", "ratio_norm"] = "none"
    """Per-step loss weight: none; `noise` = the step's transition std normalised to mean 1 over the trained
    steps (TempFlow-GRPO); `ratio_norm` = GRPO-Guard's RatioNorm of the per-step log-ratio."""
    beta: float = 0.0
    """KL coefficient; the reference is the base model (LoRA off). 0 skips the reference forward."""
    kl_std: Literal["step", "sigma"] = "step"
    """std in the Gaussian KL: the transition std (`step`), or Flow-GRPO's convention leaving sqrt(dt) out."""
    ema_decay: float = 0.0
    """EMA of the trained weights used for eval and checkpoints (0 = off; e.g. 0.9)."""
    max_minutes: float = 0.0
    """Wall-clock budget of the training in minutes (0 = none): the epoch during which it runs out is the last; the
    final eval and checkpoint follow as after the last epoch. Counted from the run's start on the clock
    `budget_clock` names, across resumes: a checkpoint keeps what was spent, a resumed run trains what is left (none
    left: nothing trains; raise max_minutes to train on)."""
    budget_clock: Literal["wall", "process"] = "wall"
    """What `max_minutes` counts: `wall` = wall-clock since the start (of each call, summed over resumes), evals
    included; `process` = this process's CPU time in training epochs (rollout, reward, update; evals not counted).
    With one torch thread `process` equals the wall-clock of an idle machine whatever else runs beside it: the fair
    budget for comparing runs (scripts/race_objectives.py) on a shared machine. Every logged row carries both, as
    `time/train_wall_minutes` and `time/train_process_minutes` (evals excluded from both)."""
    max_nonfinite_steps: int = 3
    """A minibatch whose loss or gradient is NaN/inf takes no optimizer step (a warning says so); this many such
    minibatches in a row stop the run with an error (the weights and checkpoints stay finite)."""
    seed: int = 0
    """Seed of everything: prompts order, initial noise, SDE noise, LoRA init."""
    nft: NFTConfig = field(default_factory=NFTConfig)
    """DiffusionNFT (train.objective=nft)."""
    awm: AWMConfig = field(default_factory=AWMConfig)
    """Advantage Weighted Matching (train.objective=awm)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Online Diffusion-DPO (train.objective=dpo)."""


@dataclass
class RewardSpec:
    name: str = "jpeg_compressibility"
    """Registered reward name (`rewards.available()` lists them)."""
    weight: float = 1.0
    """Weight in the combination (0 = computed and reported, not trained on)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward's constructor (paths, device, scale, ...)."""
    video_frames: int = 4
    """Video models: the frames of each video an image reward scores, evenly spaced from the first to the last
    (a video-native reward gets the whole clip)."""
    video_aggregate: Literal["mean", "min", "max"] = "mean"
    """Video models: how an image reward's frame scores make the video's score."""


@dataclass
class DataConfig:
    train_prompts: str = ""
    """Training prompts: a .txt file (one per line), a .jsonl file (a `prompt` key, other keys are metadata), or
    `hf:ORG/NAME`, a Hugging Face dataset (needs `pip install 'flowrl[hf]'`); empty = a few built-in prompts."""
    eval_prompts: str = ""
    """Held-out prompts for evaluation (same formats); empty = the training prompts."""
    balance_by: str = ""
    """A metadata column of the training prompts (e.g. `family`) whose values are drawn equally often, however
    many prompts each has (GenEval-style sets are lopsided); empty = every prompt equally often."""
    prompt_column: str = "prompt"
    """The column that holds the prompt in a .jsonl file or a `hf:` dataset (GSM8K: `question`); the other
    columns become metadata that reaches the rewards."""
    prompt_template: str = "{prompt}"
    """How the prompt column becomes the prompt: a format string over the row's columns, `{prompt}` being the
    prompt column (e.g. `"{prompt} Put the final answer in \\boxed{{}}."`)."""
    image_column: str = "image"
    """The .jsonl column of a prompt's conditioning images (image editing, image-to-video): a path or a list of
    paths relative to the .jsonl file, checked before the model loads; "" = the column is plain metadata (always so
    for backend=text)."""
    hf_config: str = ""
    """`hf:` datasets: the dataset's configuration (subset) name, e.g. `main` for `openai/gsm8k`; "" = its default."""
    train_split: str = "train"
    """`hf:` datasets: the split the training prompts come from."""
    eval_split: str = "test"
    """`hf:` datasets: the split the eval prompts come from."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate every N epochs (0 = only at the end)."""
    before: bool = True
    """Also evaluate the starting model (epoch 0) when a run starts fresh, so curves show where they began."""
    num_steps: int = 20
    """ODE steps for evaluation."""
    guidance_scale: float = 4.5
    """CFG scale for evaluation."""
    num_prompts: int = 8
    """Held-out prompts evaluated (0 = all)."""
    images_per_prompt: int = 1
    """Images per eval prompt."""
    images_per_group: int = 0
    """With `group_by`: the images of every group, shared evenly by its prompts (a group of g prompts gives each
    images_per_group / g images), so that every group's mean is equally precise however many prompts it has;
    it then replaces images_per_prompt and must be a multiple of every group's prompt count. 0 = off."""
    seed: int = 1234
    """Seed of the eval noise (the same every evaluation, so grids compare)."""
    grid: bool = True
    """Save an image grid of the eval samples in the run directory (videos: a contact sheet of each one's first,
    middle and last frames, and each video as an animation beside the grid)."""
    video_format: Literal["webp", "gif", "mp4"] = "webp"
    """Video models: how eval (and `flowrl sample`) videos are written: animated WebP or GIF (Pillow), or MP4
    where imageio[ffmpeg] is installed (else WebP, with a warning)."""
    fps: float = 8.0
    """Video models: frames per second of the written videos."""
    group_by: str = ""
    """A metadata column of the eval prompts (e.g. `family`) to break every eval score down by: logs
    `eval/<score>_by_<column>/<value>` and `eval/<score>_<column>_mean`, the unweighted mean over the groups
    (GenEval's "overall" is this mean over its task families). "" = off."""
    diversity_features: str = ""
    """A vision backbone (hub id or local directory of a DINOv2, CLIP or CLIP vision model, e.g.
    `facebook/dinov2-small`) that embeds every eval image, for the feature-space diversity: logs
    `eval/diversity/features/spread` (the mean pairwise cosine distance of each prompt's images, averaged over
    prompts), `..._spread_from_base` (its ratio to the base model's at the eval before training: 1 = as diverse,
    below 1 = narrowed) and `..._distance_from_base` (the Euclidean energy distance from the base model's images of
    each prompt, averaged over prompts: 0 = unchanged). Needs >= 2 images of every prompt (eval.images_per_prompt,
    or eval.images_per_group) and an image model (not a video one). "" = off."""


@dataclass
class LogConfig:
    run_dir: str = "runs/default"
    """Directory for metrics.jsonl, checkpoints, grids and TensorBoard logs."""
    every: int = 1
    """Log metrics every N epochs."""
    tensorboard: bool = False
    """Also log to TensorBoard through accelerate's trackers."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `wandb` installed)."""
    progress: bool = True
    """Progress bars."""
    completions_every: int = 10
    """Text: write the epoch's (prompt, completion, rewards, advantage) table to completions.jsonl every N epochs."""
    overwrite: bool = False
    """Start afresh in a run_dir that holds another run's checkpoints or metrics, deleting that run's files
    (checkpoints, metrics, grids, plots, logs). Without it such a run_dir is an error unless the run resumes
    (checkpoint.resume=auto)."""


@dataclass
class CheckpointConfig:
    every: int = 10
    """Save every N epochs (0 = only at the end), so a crash loses at most N epochs."""
    resume: Optional[str] = None
    """`auto` (the newest checkpoint in run_dir) or a checkpoint directory."""
    keep: int = 2
    """Checkpoints kept (older ones of this run are deleted; 0 = keep all)."""


@dataclass
class Config:
    backend: Literal["image", "text"] = "image"
    """What is trained: a diffusers image generator, or a Hugging Face causal LM."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The image generator."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter (or full fine-tuning)."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Rollouts (group_size and prompts_per_epoch apply to text too; the rest is for images)."""
    text: TextConfig = field(default_factory=TextConfig)
    """Text rollouts and the token-level loss (backend: text)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The update: GRPO, or another objective (train.objective)."""
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    """Rewards and their weights."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""


# ----------------------------------------------------------------------------------------- docs


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls` (read from its source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _dataclass_of(tp) -> type | None:
    return tp if dataclasses.is_dataclass(tp) else None


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type text, default, doc) for every leaf field, for `flowrl train --help`."""
    rows = []
    docs = field_docs(cls)
    hints = _hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + f.name
        sub = _dataclass_of(tp)
        if sub is not None:
            rows.extend(describe(sub, key + "."))
        else:
            rows.append((key, _type_text(tp), getattr(default, f.name), docs.get(f.name, "")))
    return rows


def _type_text(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_text(args[0]) + "|null"
    if origin is list:
        (arg,) = typing.get_args(tp)
        return f"list[{_type_text(arg)}]"
    if origin is dict:
        return "dict"
    return getattr(tp, "__name__", str(tp))


# ----------------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric field: [lo, hi] with either end open or absent (NaN/inf never pass)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if value != value or value in (float("inf"), float("-inf")):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def text(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return "a finite number"


POSITIVE, AT_LEAST_0, AT_LEAST_1, FRACTION = Range(0, lo_open=True), Range(0), Range(1), Range(0, 1, True, False)

#: The valid range of every numeric field (list fields: each item), checked by `validate`; a test walks the tree
#: and asserts that each field is listed here and refuses a value outside its range.
RANGES: dict[str, Range] = {
    "lora.rank": AT_LEAST_1, "lora.alpha": POSITIVE, "lora.dropout": Range(0, 1, hi_open=True),
    "sample.num_steps": AT_LEAST_1, "sample.guidance_scale": AT_LEAST_0,
    "sample.noise_level": Range(0, 10, lo_open=True), "sample.height": AT_LEAST_1, "sample.width": AT_LEAST_1,
    "sample.group_size": Range(2), "sample.prompts_per_epoch": AT_LEAST_1, "sample.rollout_batch_size": AT_LEAST_0,
    "sample.max_sequence_length": AT_LEAST_1,
    "sample.window.start": AT_LEAST_0, "sample.window.size": AT_LEAST_0, "sample.window.every": AT_LEAST_1,
    "sample.window.stride": AT_LEAST_1,
    "text.max_new_tokens": AT_LEAST_1, "text.max_prompt_length": AT_LEAST_1, "text.temperature": POSITIVE,
    "text.top_p": FRACTION, "text.top_k": AT_LEAST_0, "text.entropy_coef": AT_LEAST_0,
    "train.epochs": AT_LEAST_0, "train.inner_epochs": AT_LEAST_1, "train.minibatch_size": AT_LEAST_0,
    "train.steps_per_forward": AT_LEAST_1, "train.micro_batch_size": AT_LEAST_0, "train.lr": POSITIVE,
    "train.weight_decay": AT_LEAST_0,
    "train.adam_betas": Range(0, 1, hi_open=True), "train.adam_eps": POSITIVE, "train.warmup_steps": AT_LEAST_0,
    "train.decay_frac": FRACTION, "train.max_grad_norm": AT_LEAST_0, "train.clip_low": FRACTION,
    "train.clip_high": POSITIVE, "train.dual_clip": Range(1, lo_open=True), "train.adv_clip_max": POSITIVE,
    "train.stat_buffer_size": AT_LEAST_1, "train.stat_min_count": AT_LEAST_1, "train.beta": AT_LEAST_0,
    "train.ema_decay": Range(0, 1, hi_open=True), "train.max_nonfinite_steps": AT_LEAST_1,
    "train.max_minutes": AT_LEAST_0, "train.seed": AT_LEAST_0,
    "train.nft.beta": POSITIVE, "train.nft.adv_clip": POSITIVE, "train.nft.policy_scale": POSITIVE,
    "train.nft.kl_coef": AT_LEAST_0, "train.nft.decay_rate": AT_LEAST_0, "train.nft.decay_cap": Range(0, 1),
    "train.nft.decay_start": AT_LEAST_0, "train.nft.timesteps": AT_LEAST_0,
    "train.awm.ghuber_power": POSITIVE, "train.awm.advantage_clip": POSITIVE, "train.awm.kl_coef": AT_LEAST_0,
    "train.awm.ema_kl_coef": AT_LEAST_0, "train.awm.ema_decay_rate": AT_LEAST_0,
    "train.awm.ema_decay_cap": Range(0, 1),
    "train.awm.timesteps": AT_LEAST_1, "train.awm.timestep_fraction": FRACTION,
    "train.dpo.beta": POSITIVE, "train.dpo.timesteps": AT_LEAST_0,
    "rewards.weight": Range(), "rewards.video_frames": AT_LEAST_1,
    "eval.every": AT_LEAST_0, "eval.num_steps": AT_LEAST_1, "eval.guidance_scale": AT_LEAST_0,
    "eval.num_prompts": AT_LEAST_0, "eval.images_per_prompt": AT_LEAST_1, "eval.images_per_group": AT_LEAST_0,
    "eval.seed": AT_LEAST_0, "eval.fps": POSITIVE, "sample.num_frames": AT_LEAST_0,
    "log.every": AT_LEAST_1, "log.completions_every": AT_LEAST_0,
    "checkpoint.every": AT_LEAST_0, "checkpoint.keep": AT_LEAST_0,
}

#: Names users bring from TRL, diffusers' training scripts, Flow-GRPO and DDPO -> the flowrl key.
ALIASES: dict[str, str] = {
    # TRL (GRPOConfig / TrainingArguments)
    "learning_rate": "train.lr", "num_generations": "sample.group_size", "num_train_epochs": "train.epochs",
    "num_iterations": "train.inner_epochs", "epsilon": "train.clip_low", "epsilon_high": "train.clip_high",
    "delta": "train.dual_clip", "max_completion_length": "text.max_new_tokens",
    "per_device_train_batch_size": "train.minibatch_size", "scale_rewards": "train.adv_scale",
    "loss_type": "text.loss_agg", "reward_weights": "rewards", "reward_funcs": "rewards",
    "lr_scheduler_type": "train.schedule", "adam_beta1": "train.adam_betas", "adam_beta2": "train.adam_betas",
    "adam_epsilon": "train.adam_eps", "output_dir": "log.run_dir", "logging_steps": "log.every",
    "save_steps": "checkpoint.every", "save_total_limit": "checkpoint.keep",
    "resume_from_checkpoint": "checkpoint.resume", "model_name_or_path": "model.path",
    "num_inner_epochs": "train.inner_epochs", "kl_coef": "train.beta", "init_kl_coef": "train.beta",
    # diffusers training scripts
    "pretrained_model_name_or_path": "model.path", "mixed_precision": "model.dtype", "torch_dtype": "model.dtype",
    "num_inference_steps": "sample.num_steps", "resolution": "sample.height", "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "use_lora": "lora.enabled",
    "train_batch_size": "train.minibatch_size", "gradient_checkpointing": "train.gradient_checkpointing",
    # Flow-GRPO / DDPO
    "clip_range": "train.clip_low", "num_image_per_prompt": "sample.group_size", "num_epochs": "train.epochs",
    "eval_num_steps": "eval.num_steps", "global_std": "train.adv_scale", "ema": "train.ema_decay",
    "per_prompt_stat_tracking": "train.per_prompt_stats", "sde_window_size": "sample.window.size",
    "sde_window_range": "sample.window.start", "timestep_fraction": "sample.window.size",
    "use_8bit_adam": "train.optimizer", "offload_optimizer": "train.offload", "cpu_offload": "train.offload",
    "save_freq": "checkpoint.every", "eval_freq": "eval.every", "logdir": "log.run_dir",
    "num_batches_per_epoch": "sample.prompts_per_epoch", "kl_reward": "text.kl_in_reward",
}


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    return [row[0] for row in describe(cls, prefix)] + (["rewards.name", "rewards.weight", "rewards.kwargs",
                                                          "rewards.video_frames", "rewards.video_aggregate"]
                                                         if cls is Config and not prefix else [])


def _suggest(key: str) -> list[str]:
    """Valid keys close to an unknown `key`, across every section: an alias users bring from other tools first,
    then keys whose last part or whole dotted path is close."""
    keys = _all_keys()
    leaf = key.split(".")[-1]
    if leaf in ALIASES:
        return [ALIASES[leaf]]
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
        by_leaf.setdefault(k.split(".")[-1], []).append(k)
    for alias, target in ALIASES.items():
        by_leaf.setdefault(alias, []).append(target)
    out: list[str] = []
    for name in difflib.get_close_matches(leaf, list(by_leaf), n=4, cutoff=0.75):
        out.extend(by_leaf[name])
    out.extend(difflib.get_close_matches(key, keys, n=3, cutoff=0.6))
    return list(dict.fromkeys(out))[:3]


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = _suggest(key)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    leaf = key.split(".")[-1]
    if leaf in ALIASES:
        hint += f" ({leaf!r} is another tool's name for it.)"
    return ConfigError(f"unknown config key {key!r}.{hint} Valid keys here: {', '.join(valid)}")


def _convert(value: Any, tp, key: str) -> Any:
    """Check (and gently convert) `value` against the annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{key}: {value!r} is not a valid choice; valid: {', '.join(map(str, choices))}.{hint}")
        return value
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        sub = _dataclass_of(arg)
        if sub is not None:
            return [_build(sub, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return [_convert(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 without a dot as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")


def _build(cls: type, data: Any, prefix: str = ""):
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = prefix + ("." if prefix else "") + str(k)
        if k not in names:
            raise _unknown_key(key, [f"{prefix}.{n}" if prefix else n for n in names])
        sub = _dataclass_of(hints[k])
        kwargs[k] = _build(sub, v, key) if sub is not None else _convert(v, hints[k], key)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    """Put `value` at dotted `key` of the override tree, checking each part against the config's types. A list of
    sections takes an item index (`rewards.0.weight`): the tree then holds {0: {...}} for `_merge` to apply."""
    parts = key.split(".")
    node: dict = tree
    cls: Any = Config
    item_cls: Any = None  # the item type of the list of sections being indexed (cls is None meanwhile)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        prefix = ".".join(parts[:i])
        if cls is None:  # inside a list of sections: an index
            if not part.isdigit():
                raise ConfigError(f"{key!r}: {prefix} is a list; name an item by its index, e.g. {prefix}.0.weight=2 "
                                  f"(or set the whole list: {prefix}='[{{name: ..., weight: 1}}]')")
            node = node.setdefault(int(part), {})
            cls = item_cls
            if last:
                raise ConfigError(f"{key!r}: set a key of the item, e.g. {key}.weight=2")
            continue
        hints = _hints(cls)
        if part not in hints:
            raise _unknown_key(key, [f"{prefix}.{n}" if prefix else n for n in hints])
        tp = hints[part]
        if last:
            node[part] = value
            return
        if typing.get_origin(tp) is list and _dataclass_of(typing.get_args(tp)[0]) is not None:
            item_cls, cls = typing.get_args(tp)[0], None
            node = node.setdefault(part, {})
            continue
        if _dataclass_of(tp) is None:
            raise ConfigError(f"{key!r}: {'.'.join(parts[:i + 1])} is a value, not a section; set it as "
                              f"{'.'.join(parts[:i + 1])}=VALUE")
        cls = tp
        node = node.setdefault(part, {})


def _merge(base: Any, over: dict, path: str = "") -> Any:
    """`over` laid on `base`; an int-keyed mapping in `over` updates those items of a list in `base`."""
    if isinstance(base, list) and over and all(isinstance(k, int) for k in over):
        out_list = list(base)
        for i, v in over.items():
            if i >= len(out_list):
                raise ConfigError(f"{path}.{i}: the list {path} has {len(out_list)} item(s), indices 0 to "
                                  f"{len(out_list) - 1}; set the whole list to add one")
            out_list[i] = _merge(out_list[i], v, f"{path}.{i}") if isinstance(v, dict) and isinstance(
                out_list[i], dict) else v
        return out_list
    out = dict(base)
    for k, v in over.items():
        key = f"{path}.{k}" if path else str(k)
        if isinstance(v, dict) and isinstance(out.get(k), (dict, list)):
            out[k] = _merge(out[k], v, key)
        elif isinstance(v, dict) and v and all(isinstance(i, int) for i in v):  # an index into a default list
            out[k] = _merge(to_dict(Config()).get(k, []), v, key)
        else:
            out[k] = v
    return out


def parse_overrides(overrides: list[str]) -> dict:
    """`["train.lr=1e-4", "sample.group_size=8"]` -> a nested dict (values read as YAML scalars)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.lr=1e-4")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)})") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _yaml_problem(e: yaml.YAMLError) -> str:
    return " ".join(str(getattr(e, "problem", None) or e).split())


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a syntax error is one ConfigError line naming the file, line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: YAML syntax error: {_yaml_problem(e)}"
                          + (f" ({context})" if context else "")) from None


#: text.loss_preset -> the settings of the published variant (a base layer under the user's own keys).
LOSS_PRESETS: dict[str, dict] = {
    # DeepSeekMath GRPO (arXiv 2402.03300): token ratio, symmetric clip 0.2, group std, per-sequence token mean,
    # k3 KL in the loss with beta 0.04.
    "grpo": {"train": {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "adv_estimator": "grpo",
                       "adv_scale": "group", "beta": 0.04},
             "text": {"loss_agg": "seq-mean-token-mean", "kl_estimator": "k3", "kl_in_reward": False}},
    # DAPO (arXiv 2503.14476): clip-higher 0.2 / 0.28, token-level mean, no KL, dynamic sampling (groups with no
    # signal dropped), overlong completions masked.
    "dapo": {"train": {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "adv_estimator": "grpo",
                       "adv_scale": "group", "beta": 0.0, "drop_zero_adv_groups": True},
             "text": {"loss_agg": "token-mean", "mask_truncated": True}},
    # Dr.GRPO (arXiv 2503.20783): no std division, a constant normaliser (the max completion length), no KL.
    "dr_grpo": {"train": {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "adv_estimator": "grpo",
                          "adv_scale": "none", "beta": 0.0},
                "text": {"loss_agg": "seq-mean-token-sum-max-len"}},
    # GSPO (arXiv 2507.18071): sequence-level ratio, clip 3e-4 / 4e-4, per-sequence token mean, no KL.
    "gspo": {"train": {"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "adv_estimator": "grpo",
                       "adv_scale": "group", "beta": 0.0},
             "text": {"loss_agg": "seq-mean-token-mean"}},
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- loss preset <- YAML preset <- `key=value` overrides, validated; raises ConfigError with the fix."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = read_yaml(path) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    preset = (data.get("text") or {}).get("loss_preset", "none") if isinstance(data.get("text"), dict) else "none"
    if preset not in ("none", *LOSS_PRESETS):
        raise ConfigError(f"text.loss_preset: {preset!r} is not a valid choice; valid: none, {', '.join(LOSS_PRESETS)}")
    if preset != "none":
        data = _merge(LOSS_PRESETS[preset], data)
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def _get_dotted(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def range_problems(cfg: Config) -> list[str]:
    """Every numeric field outside its `RANGES` entry, as "key must be ..., got value" lines (list fields are
    checked item by item; a null optional field is not checked)."""
    problems = []
    for key, valid in RANGES.items():
        if key.startswith("rewards."):
            values = [(f"rewards[{i}].{key.split('.', 1)[1]}", getattr(r, key.split(".", 1)[1]))
                      for i, r in enumerate(cfg.rewards)]
        else:
            value = _get_dotted(cfg, key)
            values = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        problems.extend(f"{name} must be {valid.text()}, got {v!r}" for name, v in values
                        if v is not None and v not in valid)
    return problems


def _family_problems(cfg: Config) -> list[str]:
    """model.family against the registered families (flowrl.families), and what the family allows: its step
    kernels (sample.sde_type), drop_t5."""
    from .families import FAMILIES, family_names

    names = family_names()
    m, s = cfg.model, cfg.sample
    if m.family == "auto":
        return []
    if m.family not in names:
        close = difflib.get_close_matches(m.family, names, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]}?" if close else ""
        return [f"model.family: {m.family!r} is not a registered family; valid: auto, {', '.join(names)}.{hint}"]
    fam = FAMILIES.get(m.family)
    problems = []
    kernels = [k for k in fam.sde_types if k != "ode"]
    if s.sde_type != "auto" and s.sde_type not in kernels:
        problems.append(f"sample.sde_type={s.sde_type} does not fit model.family={m.family}: it takes "
                        f"{', '.join(kernels)} (ddim is for epsilon-prediction UNets, sde/cps/dance for flow models)")
    if m.drop_t5 and not fam.t5_components:
        problems.append(f"model.drop_t5 is for families with an optional T5 encoder (SD3/SD3.5), not "
                        f"model.family={m.family}")
    return problems


#: GRPO's keys about the sampler's stochastic steps -> their defaults: another objective refuses other values
GRPO_ONLY_KEYS = {"sample.window.kind": "all", "sample.sde_type": "auto", "sample.noise_level": None,
                  "train.step_weighting": "none", "train.beta": 0.0, "train.policy_loss": "ppo_clip",
                  "train.dual_clip": None, "train.kl_std": "step"}


def _cli_value(value) -> str:
    """A value as a key=value override writes it (None as null, booleans in lower case)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _objective_problems(cfg: Config) -> list[str]:
    """What a forward-process objective (train.objective nft / awm / dpo) cannot take."""
    s, t = cfg.sample, cfg.train
    name = t.objective
    if cfg.backend != "image":
        return [f"train.objective={name} trains image generators only for now (backend=image); use "
                f"train.objective=grpo with backend={cfg.backend}"]
    problems = []
    changed = [k for k, default in GRPO_ONLY_KEYS.items() if _get_dotted(cfg, k) != default]
    if changed:
        problems.append(f"{', '.join(f'{k}={_get_dotted(cfg, k)}' for k in changed)}: GRPO's setting(s) of the "
                        f"sampler's stochastic steps; train.objective={name} samples with the ODE and trains at its "
                        f"own times (train.{name}.*: its KL is train.{name}.kl_coef). Leave them at their defaults "
                        f"({' '.join(f'{k}={_cli_value(GRPO_ONLY_KEYS[k])}' for k in changed)}), or use "
                        f"train.objective=grpo")
    if s.same_noise_per_group:
        problems.append(f"sample.same_noise_per_group: with train.objective={name} the ODE rollout would make every "
                        "image of a group the same; set it to false")
    times = getattr(t, name).timesteps
    if name in ("nft", "dpo") and times > s.num_steps:
        problems.append(f"train.{name}.timesteps={times} exceeds sample.num_steps={s.num_steps}: the training times "
                        f"are distinct steps of the rollout's schedule; use at most {s.num_steps} (0 = the default)")
    return problems


def _eval_features_problems(cfg: Config) -> list[str]:
    """eval.diversity_features: an image backend, and >= 2 images of every prompt (with eval.images_per_group the
    prompts' shares are checked with the prompts, by the preflight)."""
    e = cfg.eval
    if not e.diversity_features:
        return []
    if cfg.backend != "image":
        return [f"eval.diversity_features={e.diversity_features} embeds generated images, and backend={cfg.backend} "
                "makes text; set eval.diversity_features='' (off)"]
    if not e.images_per_group and e.images_per_prompt < 2:
        return [f"eval.diversity_features measures how far apart each prompt's images are, and "
                f"eval.images_per_prompt={e.images_per_prompt} gives each prompt one; set eval.images_per_prompt=2 "
                "or more (or eval.images_per_group with eval.group_by), or eval.diversity_features='' (off)"]
    return []


def validate(cfg: Config) -> None:
    """Value checks that need more than a type: every numeric field's range, and relations between keys."""
    s, t = cfg.sample, cfg.train
    problems = range_problems(cfg)
    batch = s.group_size * s.prompts_per_epoch
    if t.minibatch_size and batch % t.minibatch_size:
        problems.append(f"train.minibatch_size={t.minibatch_size} must divide the epoch batch "
                        f"{batch} (= sample.prompts_per_epoch x sample.group_size)")
    if s.rollout_batch_size and batch % s.rollout_batch_size:
        problems.append(f"sample.rollout_batch_size={s.rollout_batch_size} must divide the epoch batch {batch}")
    w = s.window
    if w.kind != "all":
        if w.size < 1 or w.start < 0 or w.start + w.size > s.num_steps:
            problems.append(f"sample.window: [start, start+size) = [{w.start}, {w.start + w.size}) must lie in "
                            f"[0, sample.num_steps={s.num_steps}) with size >= 1")
    if s.noise_level is not None and s.noise_level > 1 and s.sde_type in ("cps", "ddim"):
        problems.append(f"sample.noise_level must be in (0, 1] for sde_type={s.sde_type} (CPS's angle fraction, "
                        f"DDIM's eta), got {s.noise_level}")
    if t.per_prompt_stats and t.stat_min_count > t.stat_buffer_size:
        problems.append(f"train.stat_min_count={t.stat_min_count} exceeds train.stat_buffer_size="
                        f"{t.stat_buffer_size}: the per-prompt statistics would never be used")
    problems.extend(_eval_features_problems(cfg))
    if cfg.eval.images_per_group and not cfg.eval.group_by:
        problems.append(f"eval.images_per_group={cfg.eval.images_per_group} shares images out over the groups of "
                        "eval.group_by, which is not set; set eval.group_by (e.g. family) or images_per_group=0")
    if not cfg.rewards:
        problems.append("rewards: at least one reward is needed")
    elif not any(r.weight for r in cfg.rewards):
        problems.append(f"rewards: every weight is 0 ({', '.join(r.name for r in cfg.rewards)}), so there is nothing "
                        "to train on; give at least one reward a non-zero weight (weight 0 = report only)")
    if cfg.backend == "image":
        problems.extend(_family_problems(cfg))
    if t.optimizer == "adamw_8bit" and t.sharding == "fsdp":
        problems.append("train.optimizer=adamw_8bit cannot step FSDP's sharded weights (bitsandbytes' 8-bit states "
                        "are per whole tensor); use train.optimizer=adamw with train.sharding=fsdp, or sharding=none")
    if t.schedule_over == "budget" and not t.max_minutes:
        problems.append("train.schedule_over=budget decays the lr over the time budget, and train.max_minutes is 0 "
                        "(none); set train.max_minutes, or train.schedule_over=epochs")
    if t.objective != "grpo":
        problems.extend(_objective_problems(cfg))
    if t.step_weighting == "ratio_norm" and s.sde_type not in ("auto", "sde", "dance"):
        problems.append("train.step_weighting=ratio_norm needs a Gaussian SDE step (sample.sde_type sde or dance)")
    from .core import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    if t.adv_estimator not in ADVANTAGE_ESTIMATORS:
        problems.append(f"train.adv_estimator {t.adv_estimator!r} is not registered; valid: "
                        f"{', '.join(ADVANTAGE_ESTIMATORS.names())}")
    if t.policy_loss not in POLICY_LOSSES:
        problems.append(f"train.policy_loss {t.policy_loss!r} is not registered; valid: "
                        f"{', '.join(POLICY_LOSSES.names())}")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
