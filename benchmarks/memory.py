"""Measured peak memory of one GRPO update (and of the rollout) beside `flowrl plan`'s estimate, on mid-size random
models, on the CPU.

    python benchmarks/memory.py                   # SD3, FLUX.1, SD1.5-style UNet and Qwen2 models; micro-batch 1, 4, 16
    python benchmarks/memory.py --models sd3 --micro 1 2 --fit
    python benchmarks/memory.py --models sd3 --size 384 --set num_layers=12 num_attention_heads=12 --micro 1 2
    python benchmarks/memory.py --models sd3 --micro 1 --vae      # also SD3.5's VAE decoder

There is no torch.cuda on a CPU, so the peak is measured by `LiveTensorBytes`, a TorchDispatchMode that sees
every tensor an aten op returns, counts the bytes of each new storage once and subtracts them when the storage
is freed (a weakref finalizer on the storage object, which PyTorch keeps alive exactly as long as the storage):
the quantity torch.cuda.max_memory_allocated measures on a GPU, without the caching allocator's rounding.

Each image model is a random-weight pipeline saved to a temporary directory: tiny text encoders and a VAE with 8
channels (their size is not what is measured), a mid-size denoiser (MODELS). Each causal LM is a random Qwen2
with samples/arith's tokenizer (TEXT_MODELS). The run is the real trainer (flowrl.train.Trainer): one rollout,
one warm-up update (it creates the AdamW states), then the measured update, with `micro_batch_size` samples per
micro-batch (= the minibatch) and gradient checkpointing off or on. Reported, in MiB:
  static   the tensors alive when the update starts: weights, LoRA, AdamW states, EMA, trajectory, prompt cache;
  dynamic  the peak of what the update allocates on top: activations, gradients, the optimizer step's temporaries;
  rollout  the peak of a rollout of `micro` images (at least 2) through the denoiser without gradients, on top of
           the trajectory it records (images; the VAE decoder is measured apart, with --vae, at its real width),
           or of the text rollout (generate, then the old log-probs of the batch) on top of the batch it returns;
beside the planner's figures for the same config (`flowrl.plan.plan` on the saved directory) and their ratios.
`--fit` solves the factors a family declares (`plan_calibration` in flowrl/families/) and flowrl.plan.text's
LM_CALIBRATION (see flowrl.plan.activation_bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIB = 2**20


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated while the mode is active and still alive: `now`, and its
    maximum `peak`. A storage an op returns that none of its inputs holds is new (views and in-place results
    are not); it is counted when it appears and uncounted when it is freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in held or key in self.live:
                continue
            self.live[key] = storage.nbytes()
            self.now += self.live[key]
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind `tensors`."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------------------------------ the models


def _vae(latent_channels: int, *, flow: bool):
    """A VAE with the real 8x downsampling (four blocks) and 8 channels: cheap to decode, the true latent size."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=256,
        scaling_factor=1.5 if flow else 0.18215,
        shift_factor=0.06 if flow else None,
        use_quant_conv=not flow,
        use_post_quant_conv=not flow,
    )


#: name -> (tiny family model whose text encoders are reused, attribute, denoiser class, its config)
MODELS = {
    # SD3.5-Medium's block structure (dual attention in the first blocks, qk RMS norm), 512 wide, 8 blocks
    "sd3": (
        "tiny-sd3",
        "transformer",
        "SD3Transformer2DModel",
        dict(
            sample_size=32,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=8,
            attention_head_dim=64,
            num_attention_heads=8,
            joint_attention_dim=64,
            caption_projection_dim=512,
            pooled_projection_dim=64,
            pos_embed_max_size=64,
            dual_attention_layers=(0, 1, 2, 3),
            qk_norm="rms_norm",
        ),
    ),
    # FLUX.1's structure: double- then single-stream blocks, 512 wide
    "flux": (
        "tiny-flux",
        "transformer",
        "FluxTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=64,
            num_layers=3,
            num_single_layers=6,
            attention_head_dim=64,
            num_attention_heads=8,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(16, 24, 24),
        ),
    ),
    # SD1.5's UNet at a fifth of its width
    "unet": (
        "tiny-sd15",
        "unet",
        "UNet2DConditionModel",
        dict(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(64, 128, 256, 256),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        ),
    ),
}


def save_model(name: str, directory: str, **denoiser_overrides) -> str:
    """Save the mid-size pipeline `name` (MODELS; its denoiser config updated by denoiser_overrides) to
    `directory`; returns it."""
    import diffusers

    from flowrl.families import tiny_pipeline

    tiny, attr, class_name, config = MODELS[name]
    pipe = tiny_pipeline(tiny)
    torch.manual_seed(0)
    denoiser = getattr(diffusers, class_name)(**{**config, **denoiser_overrides})
    latent = config["in_channels"] // (4 if name == "flux" else 1)
    setattr(pipe, attr, denoiser)
    pipe.vae = _vae(latent, flow=name != "unet")
    pipe.save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------ one measurement


def measure(
    directory: str,
    *,
    micro: int,
    checkpointing: bool,
    size: int = 256,
    dtype: str = "bfloat16",
    lora: bool = True,
    beta: float = 0.01,
    steps_per_forward: int = 1,
    work: str | None = None,
) -> dict:
    """One trainer update on the saved model at `directory` with micro-batches of `micro` samples (minibatch =
    micro, so the peak is one micro-batch's); its measured static and dynamic memory and the planner's."""
    from flowrl.config import load_config
    from flowrl.plan import DTYPE_BYTES, plan
    from flowrl.train import Trainer

    work = work or tempfile.mkdtemp(prefix="flowrl-memory-")
    os.makedirs(work, exist_ok=True)
    group = max(2, micro)
    prompts = Path(work) / "prompts.txt"
    prompts.write_text("a red cube\n")  # one prompt: the cache holds it (and the negative prompt)
    overrides = [
        f"model.path={directory}",
        "model.device=cpu",
        f"model.dtype={dtype}",
        f"sample.height={size}",
        f"sample.width={size}",
        "sample.num_steps=2",
        "sample.prompts_per_epoch=1",
        f"sample.group_size={group}",
        "sample.max_sequence_length=16",
        f"train.grpo.beta={beta}",
        f"train.steps_per_forward={steps_per_forward}",
        f"train.minibatch_size={micro}",
        f"train.micro_batch_size={micro}",
        f"train.gradient_checkpointing={str(checkpointing).lower()}",
        f"lora.enabled={str(lora).lower()}",
        "log.progress=false",
        f"log.run_dir={work}/run",
        "log.overwrite=true",
        "eval.before=false",
        f"data.train_prompts={prompts}",
        "rewards=[{name: jpeg_compressibility}]",
    ]
    cfg = load_config(None, overrides)
    estimate = plan(cfg, gpus=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(cfg)
        batch = trainer.rollout(0)
        adv = torch.linspace(-1, 1, len(batch.prompts))
        keep = torch.ones(len(adv), dtype=torch.bool)
        trainer.update(batch, adv, keep, 0)  # warm-up: creates the AdamW states
        trainer.opt.zero_grad(set_to_none=True)
        backend = trainer.policy.backend
        tensors = [
            t
            for m in backend.pipe.components.values()
            if isinstance(m, torch.nn.Module)
            for t in [*m.parameters(), *m.buffers()]
        ]
        tensors += [v for state in trainer.opt.state.values() for v in state.values()]
        tensors += list(trainer.ema.shadow.values()) if trainer.ema else []
        tensors += [v for v in vars(batch.traj).values() if isinstance(v, torch.Tensor)]
        tensors += [t for row in backend._prompt_cache.values() for t in row.values()]
        tensors += list((backend._negative or {}).values())
        static = storage_bytes(tensors)
        t0 = time.perf_counter()
        with LiveTensorBytes() as tracker:
            trainer.update(batch, adv, keep, 0)
        seconds = time.perf_counter() - t0
        # the rollout's denoiser (no gradients, the prompts already encoded), without the VAE decode: its peak
        # on top of the trajectory it records
        policy = trainer.policy
        with LiveTensorBytes() as rollout_tracker:
            traj = backend.rollout(
                batch.prompts[:1],
                group_size=group,
                num_steps=2,
                sde_window=policy.stochastic_sampler()[1],
                height=size,
                width=size,
                seed=1,
                decode=False,
                deterministic_context=policy.merged_adapter,
            )
        rollout = rollout_tracker.peak - storage_bytes(v for v in vars(traj).values() if isinstance(v, torch.Tensor))
    planned_static = estimate.fits["DDP"].static_gib * 2**30 - estimate.update.grads
    return dict(
        micro=micro,
        checkpointing=checkpointing,
        dtype=dtype,
        lora=lora,
        size=size,
        static=static,
        dynamic=tracker.peak,
        seconds=seconds,
        rollout=rollout,
        rollout_images=group,
        planned_rollout=group * estimate.rollout.phases["denoiser"][0],
        rollout_once=0.0,
        rollout_units=group
        * estimate.rollout.phases["denoiser"][0]
        / (estimate.update.calibration.gamma * DTYPE_BYTES[dtype]),
        planned_static=planned_static,
        planned_dynamic=estimate.update.dynamic(micro, checkpointing),
        rows=estimate.update.rows_per_sample,
        grads=estimate.update.grads,
        terms=estimate.update.terms._asdict(),
        class_name=estimate.update.class_name,
    )


#: SD3.5's VAE (FLUX.1's and SD1.5's have its decoder: 128 / 256 / 512 / 512 channels, 2 layers per block)
SD3_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=32,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def measure_vae_decode(images: int, size: int, dtype: str = "bfloat16") -> dict:
    """The peak of decoding `images` latents to size x size images (no gradients) with a random-weight VAE of
    SD3.5's architecture, on top of the latents and the weights; and the planner's estimate."""
    from diffusers import AutoencoderKL

    from flowrl.plan import DTYPE_BYTES, vae_decode_bytes

    torch.manual_seed(0)
    vae = AutoencoderKL(**SD3_VAE).to(getattr(torch, dtype)).eval()
    latents = torch.randn(images, 16, size // 8, size // 8, dtype=vae.dtype)
    with torch.no_grad(), LiveTensorBytes() as tracker:
        vae.decode(latents, return_dict=False)
    planned = images * vae_decode_bytes({"_class_name": "AutoencoderKL", **SD3_VAE}, size, size, DTYPE_BYTES[dtype])
    return dict(
        images=images,
        size=size,
        dtype=dtype,
        decode=tracker.peak,
        planned_decode=planned,
        units=images * size * size * SD3_VAE["block_out_channels"][0],
    )


#: causal LMs (Qwen2 architecture, random weights, samples/arith's character tokenizer): one with Qwen2.5's
#: 151,936-entry vocabulary, where the output head dominates, one with a small vocabulary, where the layers do
TEXT_MODELS = {
    "qwen2-vocab": dict(
        vocab_size=151936,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2-layers": dict(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2-deep": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def save_text_model(name: str, directory: str) -> str:
    """Save the random causal LM `name` (TEXT_MODELS) with samples/arith's tokenizer to `directory`."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM

    arith = Path(__file__).resolve().parents[1] / "samples" / "arith"
    torch.manual_seed(0)
    config = Qwen2Config(
        **TEXT_MODELS[name], bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=512
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(arith / file, Path(directory) / file)
    return directory


def measure_text(
    directory: str,
    *,
    micro: int,
    checkpointing: bool,
    new_tokens: int = 64,
    dtype: str = "bfloat16",
    lora: bool = True,
    beta: float = 0.04,
    work: str | None = None,
) -> dict:
    """One text update (GRPO on samples/arith's prompts) of the causal LM at `directory`, as `measure` does for
    images; the planner is asked about the batch's real length (prompt + completion tokens)."""
    import dataclasses

    from flowrl.config import load_config
    from flowrl.plan import plan
    from flowrl.train import Trainer

    work = work or tempfile.mkdtemp(prefix="flowrl-memory-")
    arith = Path(__file__).resolve().parents[1] / "samples" / "arith"
    group = max(2, micro)
    overrides = [
        "backend=text",
        f"model.path={directory}",
        "model.device=cpu",
        f"model.dtype={dtype}",
        "sample.prompts_per_epoch=1",
        f"sample.group_size={group}",
        f"text.max_new_tokens={new_tokens}",
        "text.chat_template=false",
        f"train.grpo.beta={beta}",
        f"train.minibatch_size={micro}",
        f"train.micro_batch_size={micro}",
        f"train.gradient_checkpointing={str(checkpointing).lower()}",
        f"lora.enabled={str(lora).lower()}",
        "lora.rank=16",
        "log.progress=false",
        f"log.run_dir={work}/run",
        "log.overwrite=true",
        "eval.before=false",
        f"data.train_prompts={arith / 'train.jsonl'}",
        "rewards=[{name: accuracy}]",
    ]
    cfg = load_config(None, overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(cfg)
        with LiveTensorBytes() as rollout_tracker:  # generate, then the old log-probs of the batch in one forward
            batch = trainer.rollout(0)
        rollout = rollout_tracker.peak - storage_bytes(v for v in vars(batch).values() if isinstance(v, torch.Tensor))
        adv = torch.linspace(-1, 1, len(batch.prompts))
        keep = torch.ones(len(adv), dtype=torch.bool)
        trainer.update(batch, adv, keep, 0)
        trainer.opt.zero_grad(set_to_none=True)
        model = trainer.policy.model
        tensors = [*model.parameters(), *model.buffers()]
        tensors += [v for state in trainer.opt.state.values() for v in state.values()]
        static = storage_bytes(tensors)
        t0 = time.perf_counter()
        with LiveTensorBytes() as tracker:
            trainer.update(batch, adv, keep, 0)
        seconds = time.perf_counter() - t0
    prompt_tokens = batch.input_ids.shape[1] - new_tokens
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, max_prompt_length=prompt_tokens))
    estimate = plan(cfg, gpus=1)
    return dict(
        micro=micro,
        checkpointing=checkpointing,
        dtype=dtype,
        lora=lora,
        tokens=batch.input_ids.shape[1],
        static=static,
        dynamic=tracker.peak,
        seconds=seconds,
        rollout=rollout,
        rollout_images=group,
        planned_rollout=estimate.rollout.peak(group, "DDP"),
        rollout_units=group * estimate.update.head_units,
        rollout_once=estimate.rollout.chunk(group),
        planned_static=estimate.fits["DDP"].static_gib * 2**30 - estimate.update.grads,
        planned_dynamic=estimate.update.dynamic(micro, checkpointing),
        rows=1,
        grads=estimate.update.grads,
        terms=estimate.update.terms._asdict(),
        head_units=estimate.update.head_units,
        chunk_units=estimate.update.chunk_units(micro),
        class_name="causal LM",
    )


def fit(results: list[dict]) -> dict[str, dict[str, float]]:
    """The activation factors per model class (flowrl.plan.Calibration), from the activations per model row
    measured, (dynamic - gradients) / (micro-batch x rows): alpha (and a causal LM's head and chunk factors) by
    least squares on the relative errors of the runs without checkpointing; kappa and rho by the smallest
    worst relative error over the runs with it (a grid of steps of 0.01)."""
    from flowrl.plan import DTYPE_BYTES

    out = {}
    for cls in sorted({r["class_name"] for r in results}):
        mine = [r for r in results if r["class_name"] == cls]

        def rows(r):
            return r["micro"] * r["rows"]

        def measured(r):  # activations per model row
            return (r["dynamic"] - r["grads"]) / rows(r)

        def chunk(r):  # a causal LM's log-prob chunk buffers, per model row
            return 4 * r.get("chunk_units", 0) / rows(r)

        plain = [r for r in mine if not r["checkpointing"]]
        lm = any(r.get("head_units", 0) for r in plain)
        a = [
            [
                DTYPE_BYTES[r["dtype"]] * r["terms"]["units"] / measured(r),
                DTYPE_BYTES[r["dtype"]] * r.get("head_units", 0) / measured(r),
                chunk(r) / measured(r),
            ]
            for r in plain
        ]
        a = torch.tensor(a if lm else [x[:1] for x in a], dtype=torch.float64)
        target = torch.tensor([(measured(r) - r["terms"]["lora"]) / measured(r) for r in plain], dtype=torch.float64)
        solution = torch.linalg.lstsq(a, target[:, None]).solution[:, 0].tolist()
        alpha, head, chunk_factor = solution if lm else [solution[0], 0.0, 0.0]

        def checkpointed(r, kappa, rho):  # flowrl.plan.activation_bytes' formula, per model row
            terms, b = r["terms"], DTYPE_BYTES[r["dtype"]]
            recompute = rho * b * terms["units_checkpointed"] + terms["lora_checkpointed"]
            head_phase = head * b * r.get("head_units", 0) + chunk_factor * chunk(r)
            return kappa * b * terms["kept"] + max(recompute, head_phase)

        ckpt = [r for r in mine if r["checkpointing"]]
        best = (float("inf"), float("nan"), float("nan"))
        for kappa in (k / 100 for k in range(50, 301)):
            for rho in (x / 100 for x in range(int(alpha * 100), 401, 2)):
                worst = max((abs(checkpointed(r, kappa, rho) / measured(r) - 1) for r in ckpt), default=0.0)
                best = min(best, (worst, kappa, rho))
        # gamma: the rollout without gradients, (measured - what comes once) / (b x units), least squares on the
        # relative errors
        with_rollout = [r for r in mine if r.get("rollout_units")]
        num = den = 0.0
        for r in with_rollout:
            x = DTYPE_BYTES[r["dtype"]] * r["rollout_units"] / r["rollout"]
            num, den = num + x * (r["rollout"] - r["rollout_once"]) / r["rollout"], den + x * x
        out[cls] = dict(
            alpha=alpha,
            kappa=best[1],
            rho=best[2],
            head=head,
            chunk=chunk_factor,
            gamma=num / den if den else float("nan"),
            worst_checkpointed=best[0],
        )
    return out


def print_table(results: list[dict]) -> None:
    width = max(8, *(len(r["name"]) + 2 for r in results))
    print(
        f"{'model':<{width}}{'micro':>6}{'ckpt':>6}{'static MiB':>12}{'planned':>10}{'dynamic MiB':>13}"
        f"{'planned':>10}{'ratio':>7}{'total MiB':>11}{'planned':>10}{'ratio':>7}{'s':>6}{'rollout':>8}"
        f"{'peak MiB':>12}{'planned':>10}{'ratio':>7}"
    )
    for r in results:
        total, planned_total = r["static"] + r["dynamic"], r["planned_static"] + r["planned_dynamic"]
        print(
            f"{r['name']:<{width}}{r['micro']:>6}{'on' if r['checkpointing'] else 'off':>6}"
            f"{r['static'] / MIB:>12.1f}{r['planned_static'] / MIB:>10.1f}"
            f"{r['dynamic'] / MIB:>13.1f}{r['planned_dynamic'] / MIB:>10.1f}"
            f"{r['planned_dynamic'] / r['dynamic']:>7.2f}"
            f"{total / MIB:>11.1f}{planned_total / MIB:>10.1f}{planned_total / total:>7.2f}{r['seconds']:>6.1f}"
            f"{r['rollout_images']:>8}{r['rollout'] / MIB:>12.1f}{r['planned_rollout'] / MIB:>10.1f}"
            f"{r['planned_rollout'] / r['rollout']:>7.2f}"
        )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[*MODELS, *TEXT_MODELS], choices=[*MODELS, *TEXT_MODELS])
    ap.add_argument("--micro", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--size", type=int, default=256, help="image side in pixels")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    ap.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=JSON",
        help="denoiser config overrides, e.g. num_layers=12 num_attention_heads=12",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fit", action="store_true", help="print the activation factors these runs give")
    ap.add_argument("--vae", action="store_true", help="also measure SD3.5's VAE decoder (1-2 images, 128-256 px)")
    ap.add_argument("--json", default=None, help="append each result to this JSON-lines file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(
        f"one GRPO update on the CPU, {args.dtype}, {'full fine-tuning' if args.full else 'LoRA'}, images "
        f"{args.size} px with beta 0.01, text 64 new tokens with beta 0.04, threads {torch.get_num_threads()}; "
        f"peak by LiveTensorBytes (a TorchDispatchMode summing live tensor storages)"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="flowrl-memory-") as tmp:
        for name in args.models:
            changes = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
            if name in TEXT_MODELS:
                directory = save_text_model(name, os.path.join(tmp, name))
            else:
                directory = save_model(name, os.path.join(tmp, name), **changes)
            for micro in args.micro:
                for ck in args.checkpointing:
                    common = dict(
                        micro=micro,
                        checkpointing=ck == "on",
                        dtype=args.dtype,
                        lora=not args.full,
                        work=os.path.join(tmp, "work"),
                    )
                    if name in TEXT_MODELS:
                        r = measure_text(directory, **common)
                    else:
                        r = measure(directory, size=args.size, **common)
                    r["name"] = name + "".join(" " + f"{k}={v}".replace(" ", "") for k, v in changes.items())
                    results.append(r)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(r) + "\n")
    print_table(results)
    if args.vae:
        for images, size in ((1, 128), (2, 128), (1, 256)):
            r = measure_vae_decode(images, size, args.dtype)
            print(
                f"VAE decode, SD3.5's VAE: {images} x {size} px: measured {r['decode'] / MIB:.1f} MiB, planned "
                f"{r['planned_decode'] / MIB:.1f} MiB, ratio {r['planned_decode'] / r['decode']:.2f}"
            )
    if args.fit:
        for cls, f in fit(results).items():
            print(
                f"fit {cls}: alpha {f['alpha']:.3f}  kappa {f['kappa']:.2f}  rho {f['rho']:.2f}"
                + (f"  head {f['head']:.3f}  chunk {f['chunk']:.3f}" if f["head"] else "")
                + f"  gamma {f['gamma']:.3f}  (worst error with checkpointing {f['worst_checkpointed']:.1%})"
            )
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
