"""The configuration tree: one dataclass per section, a docstring under each field, its valid ranges beside it.

Every objective (flowrl.objectives) brings its own section, `train.<name>` (its `Settings`), joined to `TrainConfig`
here: adding an objective adds its keys without editing this file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import keyword
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from flowrl.config.values import CHOICE_ALIASES
from flowrl.ranges import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, SEED, Range


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
    variant: Optional[str] = None
    """The weight files' variant to load (diffusers' `variant`: `fp16` reads `*.fp16.safetensors`, as
    `save_pretrained(DIR, variant="fp16")` writes them; a component without them loads its plain files); None =
    the plain files. A directory that holds only a variant's files names it before anything loads."""
    drop_t5: bool = False
    """SD3/SD3.5: leave the T5 text encoder out (diffusers' `text_encoder_3=None`): ~4.7B fewer parameters in
    memory, prompts encoded by the two CLIP encoders only (T5's part of the embedding is zeros)."""
    cudnn_attention: bool = False
    """Let PyTorch's `scaled_dot_product_attention` use its cuDNN backend when training on a CUDA GPU. Off by default:
    its backward failed with an illegal memory access for FLUX.1-dev's shapes on an H200 (torch 2.11, cuDNN 9.19;
    see docs/benchmarks.md); the flash and memory-efficient backends serve instead, at about the same speed."""


@dataclass
class LoraConfig:
    RANGES: ClassVar[dict[str, Range]] = {"rank": AT_LEAST_1, "alpha": POSITIVE, "dropout": Range(0, 1, hi_open=True)}

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
    """Start from a saved adapter instead of a fresh one: a checkpoint's `lora/` dir (diffusers' format for images,
    peft's for text) or its .safetensors file. Its recorded alpha, rank and modules must be the config's (each
    mismatch names the setting that takes it; docs/training.md)."""


@dataclass
class SampleConfig:
    RANGES: ClassVar[dict[str, Range]] = {
        "num_steps": AT_LEAST_1,
        "guidance_scale": AT_LEAST_0,
        "height": AT_LEAST_1,
        "width": AT_LEAST_1,
        "group_size": Range(2),
        "prompts_per_epoch": AT_LEAST_1,
        "rollout_batch_size": AT_LEAST_0,
        "max_sequence_length": AT_LEAST_1,
        "num_frames": AT_LEAST_0,
    }

    num_steps: int = 10
    """Denoising steps per rollout (Flow-GRPO trains on 10 and evaluates with 40)."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale during rollouts (FLUX: the distilled guidance embedding)."""
    height: int = 64
    """Image height in pixels (a multiple of the model's latent factor times its patch size)."""
    width: int = 64
    """Image width in pixels."""
    group_size: int = 4
    """Images per prompt (the GRPO group), >= 2."""
    prompts_per_epoch: int = 4
    """Prompts drawn per epoch (over all processes), each making one group of group_size samples: the epoch's batch
    is prompts_per_epoch x group_size, split evenly over the processes (a group may span two). The training prompts
    are walked in a seeded shuffled order, each once per pass, so an epoch's prompts are distinct when the set holds
    at least this many (save an epoch that spans the end of one pass and the start of the next); with fewer, some
    are drawn twice or more in every epoch, each time as a separate group (a warning says so)."""
    rollout_batch_size: int = 0
    """Images per rollout forward (0 = the whole epoch batch at once); the eval samples in calls of this many too
    (0: of one process's epoch batch)."""
    max_sequence_length: int = 77
    """T5 tokens for SD3/FLUX prompts (tiny runs: 16-32)."""
    num_frames: int = 0
    """Video families: frames per video (Wan: 4k + 1); 0 = the family's default (81 for Wan, 1 for images)."""


@dataclass
class TextConfig:
    RANGES: ClassVar[dict[str, Range]] = {
        "max_new_tokens": AT_LEAST_1,
        "max_prompt_length": AT_LEAST_1,
        "temperature": POSITIVE,
        "top_p": FRACTION,
        "top_k": AT_LEAST_0,
        "entropy_coef": AT_LEAST_0,
        "engine_correction_cap": POSITIVE,
        "engine_timeout": POSITIVE,
        "max_turns": AT_LEAST_1,
    }

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
    loss_agg: Literal[
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum-max-len",
    ] = "token-mean"
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
    engine: Literal["hf", "vllm"] = "hf"
    """What samples the rollouts: `hf`, transformers' generate() on the trained model; `vllm`, a vLLM server
    (`flowrl.engines.vllm_server`, in an environment of its own, at text.vllm_url) to which the trained weights (a
    LoRA merged) are pushed before each rollout that follows an update. See docs/text.md."""
    vllm_url: str = "http://127.0.0.1:8100"
    """The vLLM server of text.engine=vllm."""
    engine_timeout: float = 600.0
    """Seconds a request to the engine's server may take before the run stops with one line naming it."""
    engine_correction: Literal["none", "token", "sequence"] = "none"
    """The engine / trainer mismatch (text.engine=vllm): `none` takes the old log-probs from the engine (its
    numerics enter the ratio); `token` / `sequence` take them from the trainer's own forward (as
    text.old_log_probs=forward) and weight each token's loss by truncated importance sampling, min(pi_old / mu,
    cap) per token or per sequence (TRL's vllm_importance_sampling_correction). `rollout/engine_*` metrics log
    the mismatch either way."""
    engine_correction_cap: float = 2.0
    """The cap of text.engine_correction's importance weights."""
    tool_env: str = ""
    """Multi-turn rollouts with a tool: a registered environment (`calculator`) or `file.py:function` /
    `module:function` that reads the model's turn and answers with text appended to the completion (left out of the
    loss, the KL and the entropy); "" = single-turn. See flowrl.tools."""
    tool_stop: list[str] = field(default_factory=list)
    """The strings that end the model's turn (the environment answers then); [] = the environment's own (the
    calculator's: </calc>)."""
    max_turns: int = 4
    """Most model turns of a multi-turn rollout (text.max_new_tokens bounds the whole completion, replies too)."""


@dataclass
class TrainConfig:
    RANGES: ClassVar[dict[str, Range]] = {
        "epochs": AT_LEAST_0,
        "inner_epochs": AT_LEAST_1,
        "minibatch_size": AT_LEAST_0,
        "steps_per_forward": AT_LEAST_1,
        "micro_batch_size": AT_LEAST_0,
        "lr": POSITIVE,
        "weight_decay": AT_LEAST_0,
        "adam_betas": Range(0, 1, hi_open=True),
        "adam_eps": POSITIVE,
        "warmup_steps": AT_LEAST_0,
        "decay_frac": FRACTION,
        "max_grad_norm": AT_LEAST_0,
        "adv_clip_max": POSITIVE,
        "stat_buffer_size": AT_LEAST_1,
        "stat_min_count": AT_LEAST_1,
        "ema_decay": Range(0, 1, hi_open=True),
        "max_nonfinite_steps": AT_LEAST_1,
        "max_minutes": AT_LEAST_0,
        "seed": SEED,
    }

    objective: str = "grpo"
    """What the update optimises: a registered objective (flowrl.objectives), whose settings are the section
    train.<objective>; the sections of the other objectives are ignored."""
    epochs: int = 2
    """Epochs; one epoch = one rollout batch and `inner_epochs` passes of updates over it."""
    inner_epochs: int = 1
    """Passes over each rollout batch (mu); > 1 makes later passes off-policy (the ratio leaves 1)."""
    fresh_noise_per_pass: bool = False
    """The forward-process objectives (DPO, offline DPO, NFT, AWM, ELBO, CRD, DGPO) with inner_epochs > 1: each
    pass after the first noises every sample at its training times with noise of its own, instead of the first
    pass's (the same times): a second draw of the loss's expectation over the noise rather than the same points
    again. train.cache_reference, which reuses the first pass's points, cannot go with it."""
    cache_reference: bool = False
    """With inner_epochs > 1, keep the reference policy's output at each trained point from the first pass and
    reuse it in the later ones, which evaluate the same points: one reference forward per point an epoch instead of
    one per pass, the same values up to the last bits of a batched forward. The forward-process objectives (DPO,
    offline DPO, and NFT, AWM, ELBO, CRD and DGPO with their reference term) keep the velocity at each training time
    and noise: one latent per point (samples x training times, x 2 for DPO's pairs) on the model's device for the
    epoch, nothing at the shapes demo's size, about 1 MB a point for a 1024 px SD3.5 image. GRPO with a KL term
    (train.grpo.beta > 0) keeps each trained step's reference mean (image: one latent per sample and step, as the
    trajectory holds) or each completion's reference token log-probs (text)."""
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


def _with_objective_sections(base: type) -> type:
    """`base` (the train section) with `objective` one of the registered objectives and a field `<name>` per
    objective: its settings dataclass (flowrl.objectives asks each `Objective.Settings`)."""
    from flowrl.objectives import get_objective, objective_names

    names = objective_names()
    fields: list[tuple] = [("objective", Literal[tuple(names)], field(default="grpo"))]
    listing = []
    docs = {}
    for name in names:
        objective = get_objective(name)
        for alias, settings in objective.variants.items():
            CHOICE_ALIASES.setdefault("train.objective", {})[alias] = f"train.objective={name} {settings}".strip() + "."
        listing.append(f"`{name}` = {objective.title} (train.{name})" if objective.Settings else f"`{name}`")
        if objective.Settings is not None:
            fields.append((name, objective.Settings, field(default_factory=objective.Settings)))
            docs[name] = f"{objective.title}: the settings of train.objective={name}, ignored under another objective."
    docs["objective"] = (
        f"What the update optimises (flowrl.objectives): {'; '.join(listing)}. Each objective's "
        f"settings are its own section train.<objective>: switching the objective is this one key, "
        f"the sections of the other objectives are ignored."
    )
    cls = dataclasses.make_dataclass(
        base.__name__, fields, bases=(base,), namespace={"__doc__": base.__doc__, "FIELD_DOCS": docs}
    )
    cls.__module__ = base.__module__
    return cls


TrainConfig = _with_objective_sections(TrainConfig)


@dataclass
class RewardSpec:
    RANGES: ClassVar[dict[str, Range]] = {"weight": Range(), "video_frames": AT_LEAST_1}

    name: str = "jpeg_compressibility"
    """Registered reward name (`rewards.available()` lists them), or a plug-in `module:function` /
    `file.py:function`; the reward's name in the metrics (a plug-in's: its function's name). With `reward` set: only
    the name in the metrics (a label)."""
    weight: float = 1.0
    """Weight in the combination (0 = computed and reported, not trained on)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward's constructor (paths, device, scale, ...)."""
    video_frames: int = 4
    """Video models: the frames of each video an image reward scores, evenly spaced from the first to the last
    (a video-native reward gets the whole clip)."""
    video_aggregate: Literal["mean", "min", "max"] = "mean"
    """Video models: how an image reward's frame scores make the video's score."""
    pairwise: bool = False
    """Train on each sample's win rate in its group (Pref-GRPO) instead of the score itself: the reward's own judge
    when it has one (`compare`: shapes_geneval compares the prompt's clauses), else its scores compared (1 win, 0.5
    tie). The training metrics report the win rates (0.5 on average) and the score as the component `raw`; the eval
    reports the score. One process."""
    reward: str = ""
    """What is built when `name` is a label: a registered name or a plug-in; empty = `name` (a plug-in given as
    `name` is moved here, and `name` becomes its function's name)."""

    def __post_init__(self):
        # A plug-in is named in the metrics by its function, not by its path (`eval//abs/my.py:fn_mean`).
        if not self.reward and ":" in self.name:
            self.reward, self.name = self.name, self.name.rpartition(":")[2]

    @property
    def target(self) -> str:
        """What is built: `reward`, else `name`."""
        return self.reward or self.name


@dataclass
class DataConfig:
    RANGES: ClassVar[dict[str, Range]] = {"skip_no_signal": AT_LEAST_0, "skip_epochs": AT_LEAST_0}
    train_prompts: str = ""
    """Training prompts: a .txt file (one per line), a .jsonl file (a `prompt` key, other keys are metadata), a
    .json file (an array of such objects or of prompts), a .csv/.tsv file (a header row names the columns), or
    `hf:ORG/NAME`, a Hugging Face dataset (needs `pip install 'flowrl[hf]'`); empty = a few built-in prompts."""
    eval_prompts: str = ""
    """Held-out prompts for evaluation (same formats); empty = the training prompts."""
    balance_by: str = ""
    """A metadata column of the training prompts (e.g. `family`) whose values are drawn equally often, however
    many prompts each has (GenEval-style sets are lopsided); empty (`data.balance_by=` or `=null`) = every prompt
    equally often."""
    skip_no_signal: int = 0
    """Leave out of the draws a prompt whose last N groups carried no signal (every sample of the group scored
    alike on every reward: all correct or all wrong, so no advantage and no preference pair), for
    `data.skip_epochs` epochs; the draws walk on to the next prompt (with balance_by, of the same value). 0 = off
    (every prompt drawn in turn, as without it). The metric `data/groups_without_signal` is logged either way."""
    skip_epochs: int = 0
    """With skip_no_signal: how many epochs a prompt is left out (0 = the rest of the run). When every prompt is
    left out at once, all are drawn again (with a warning)."""
    prompt_column: str = "prompt"
    """The column that holds the prompt in a .jsonl, .json or .csv file or a `hf:` dataset (GSM8K: `question`,
    DrawBench: `Prompts`); the other columns become metadata that reaches the rewards."""
    eval_prompt_column: str = ""
    """The prompt column of data.eval_prompts, when it is another than data.prompt_column's (a held-out file whose
    prompts are under `question` while the training file's are under `prompt`); "" = data.prompt_column."""
    prompt_template: str = "{prompt}"
    """How the prompt column becomes the prompt: a format string over the row's columns, `{prompt}` being the
    prompt column (e.g. `"{prompt} Put the final answer in \\boxed{{}}."`)."""
    image_column: str = "image"
    """The column of a prompt's conditioning images (image editing, image-to-video): a path or a list of paths
    relative to the prompt file, checked before the model loads; "" = the column is plain metadata (always so
    for backend=text)."""
    hf_config: str = ""
    """`hf:` datasets: the dataset's configuration (subset) name, e.g. `main` for `openai/gsm8k`; "" = its default."""
    train_split: str = "train"
    """`hf:` datasets: the split the training prompts come from."""
    eval_split: str = "test"
    """`hf:` datasets: the split the eval prompts come from."""


@dataclass
class EvalConfig:
    RANGES: ClassVar[dict[str, Range]] = {
        "every": AT_LEAST_0,
        "num_steps": AT_LEAST_1,
        "guidance_scale": AT_LEAST_0,
        "num_prompts": AT_LEAST_0,
        "images_per_prompt": AT_LEAST_1,
        "images_per_group": AT_LEAST_0,
        "grid_images": AT_LEAST_0,
        "seed": SEED,
        "fps": POSITIVE,
    }

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
    grid_images: int = 0
    """At most about this many images in the eval grid (and the before/after figure drawn from it): each prompt's
    first images, the same share of every prompt's (a prompt keeps ceil(its images x grid_images / all)). The
    scores are of every image. 0 = every image."""
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
    base_cache: str = ""
    """A directory that keeps evals of base models for reuse: the eval before training is read from it when it
    holds one of this run's (the same model files, eval prompts and settings, rewards, versions and sampling code:
    flowrl.eval.base_cache), else sampled and added to it. A sweep then samples its base model's eval once; the
    demo ships its own. "" = off (every run samples its eval before training)."""
    free_reference: str = ""
    """The distribution the things prompts leave free should follow (the rewards' free-attribute counts,
    flowrl.eval.diversity: e.g. shapes_geneval's colours), for `eval/diversity/<reward>/<attribute>_tv_from_reference`
    (the total variation distance from it; beside `..._tv_from_base`, the distance from the base model's):
    `uniform` (every value a reward counts equally likely, e.g. a world that draws free colours uniformly, or a
    balance a fairness eval asks for), or a JSON file {"<reward>/<attribute>": {"<value>": weight, ...}} (weights
    normalised per attribute). The training rollouts' counts log `reward/diversity/..._tv_from_reference` from it
    too. "" = off."""
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
    RANGES: ClassVar[dict[str, Range]] = {"every": AT_LEAST_1, "completions_every": AT_LEAST_0}

    run_dir: str = "runs/default"
    """Directory for metrics.jsonl, checkpoints, grids and TensorBoard logs."""
    every: int = 1
    """Log metrics every N epochs."""
    tensorboard: bool = False
    """Also log to TensorBoard through accelerate's trackers."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `wandb` installed)."""
    progress: bool = True
    """Progress bars: flowrl's (epochs, evals), and diffusers' and transformers' bars while the model loads."""
    completions_every: int = 10
    """Text: write the epoch's (prompt, completion, rewards, advantage) table to completions.jsonl every N epochs."""
    overwrite: bool = False
    """Start afresh in a run_dir that holds another run's checkpoints or metrics, deleting that run's files
    (checkpoints, metrics, grids, plots, logs). Without it such a run_dir is an error unless the run resumes
    (checkpoint.resume=auto)."""


@dataclass
class CheckpointConfig:
    RANGES: ClassVar[dict[str, Range]] = {"every": AT_LEAST_0, "keep": AT_LEAST_0}

    every: int = 10
    """Save every N epochs (0 = only at the end), so a crash loses at most N epochs."""
    resume: Optional[str] = None
    """`auto` (the newest checkpoint in run_dir) or a checkpoint directory."""
    keep: int = 2
    """Checkpoints kept (older ones of this run are deleted; 0 = keep all). The best eval's (keep_best) is kept
    besides them."""
    keep_best: bool = False
    """Keep the weights of the best eval: at each eval that beats every earlier one on checkpoint.best_metric (the
    eval before training included) a checkpoint of that epoch is written, which checkpoint.keep never deletes, and
    `best.json` in the run directory names it (`flowrl eval --checkpoint RUN/ckpt-...` evaluates the same weights:
    the EMA when the run keeps one, as the eval did). For runs that peak and then drift."""
    best_metric: str = ""
    """The eval metric checkpoint.keep_best maximises, e.g. `eval/shapes_geneval/strict_family_mean`; "" = the
    run's headline: the first reward's mean (its mean over eval.group_by's groups when set, a `strict` component
    first). A name the eval does not report is an error at the first eval, listing those it does."""
    allow_other_base: bool = False
    """Resume (or evaluate, sample) a checkpoint although the base model's weight files at model.path changed since
    it was written (each checkpoint keeps a fingerprint of them); without it that is refused, naming the files."""


@dataclass
class RolloutConfig:
    acceleration: list[Any] = field(default_factory=list)
    """Accelerators of the image rollout's sampling (flowrl.sampling.acceleration), each a name or a mapping of its
    name and knobs, e.g. `[compile]` or `[{name: first_block_cache, threshold: 0.05}]`. Lossless ones (`compile`,
    `attention_backend`) keep the rollout on-policy; lossy ones (the step caches `first_block_cache`,
    `taylorseer_cache`, `mag_cache`, and `autocast`: the denoiser in bfloat16) change the samples' distribution and
    are refused for an objective that trains on the rollout's log-probs (grpo). They are on during the rollout only:
    not in the update, the reference pass or the evaluation. A family that cannot take one says why before sampling.
    [] = none."""
    overlap_rewards: bool = False
    """Score each rollout call's images (sample.rollout_batch_size of them) on a thread of their own while the next
    call samples, with the rewards that declare `per_sample = True` (their score of an image depends on it alone,
    and they may run on another thread: jpeg_*, shapes_geneval); the others, and any reward train.offload parks,
    score the whole batch after the rollout as without it. The scores, and all that follows, are the same as
    without it. Images only (refused for text models)."""
    async_: bool = False
    """(Written `rollout.async`.) Sample the next epoch in a rollout worker, a process of its own, while this one
    updates on the current epoch: epoch k+1 is sampled with the weights after epoch k-1's update (one version
    stale; the first epoch of a run, and of a resume, with the current weights). The trained weights go to the worker
    after every update with their version (the epochs trained). `rollout/version_lag`, `time/rollout_wait` and
    `time/worker_idle` say how it went. GRPO trains on the sampling version's log-probs (the first minibatch's ratio
    is no longer 1; clipping bounds it); the decoupled objectives (nft, awm, dpo) need only the samples. One process,
    images, without rollout.overlap_rewards (each refused otherwise)."""
    async_threads: int = 1
    """The rollout worker's torch threads (rollout.async). On a CPU the trainer updates at its own threads less these
    while the worker samples beside it, and at all of them when it does not (the eval after the last epoch)."""

    RANGES: ClassVar[dict[str, Range]] = {"async_threads": AT_LEAST_1}


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
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How image rollouts are sampled (accelerators)."""
    text: TextConfig = field(default_factory=TextConfig)
    """Text rollouts and the token-level loss (backend: text)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The update: GRPO, or another objective (train.objective) with its section train.<objective>."""
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
    """The docstring written under each field of dataclass `cls` (read from the source of it and of its bases), and
    the docs a generated class carries in `FIELD_DOCS` (the train section's objective fields)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            tree = None
        if tree is not None and tree.body and isinstance(tree.body[0], ast.ClassDef):
            body = tree.body[0].body
            for node, nxt in zip(body, body[1:]):
                if (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
        docs.update(vars(klass).get("FIELD_DOCS", {}))
    return docs


def _dataclass_of(tp) -> type | None:
    return tp if dataclasses.is_dataclass(tp) else None


def _hints(cls) -> dict[str, Any]:
    """The type of each field of dataclass `cls` (its class variables, e.g. RANGES, left out)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def section_ranges(cls: type = Config, prefix: str = "") -> dict[str, Range]:
    """The valid range of every numeric field of the tree under `cls`, by dotted key: each section's RANGES (the
    list of reward specs under `rewards.`)."""
    out = {prefix + k: r for k, r in getattr(cls, "RANGES", {}).items()}
    for name, tp in _hints(cls).items():
        if typing.get_origin(tp) is list and _dataclass_of(typing.get_args(tp)[0]) is not None:
            tp = typing.get_args(tp)[0]
        sub = _dataclass_of(tp)
        if sub is not None:
            out.update(section_ranges(sub, f"{prefix}{name}."))
    return out


def key_name(field_name: str) -> str:
    """The key users write for a field: a Python keyword is a field's name with a trailing `_` (`async_` is
    `rollout.async`)."""
    return field_name[:-1] if field_name.endswith("_") and keyword.iskeyword(field_name[:-1]) else field_name


def field_name(key: str) -> str:
    """The field of the key users write (`key_name`'s inverse)."""
    return key + "_" if keyword.iskeyword(key) else key


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type text, default, doc) for every leaf field, for `flowrl train --help`."""
    rows = []
    docs = field_docs(cls)
    hints = _hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + key_name(f.name)
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
