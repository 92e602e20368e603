"""The GPU check: flowrl's own trainer on real-size architectures, its measured peak memory beside `flowrl plan`'s
estimate for the same config, and its throughput, in one command.

    python benchmarks/gpu_check.py --out gpu-check            # on one GPU (H100 / H200): about 5 minutes
    python benchmarks/gpu_check.py --tiny --out /tmp/check    # the same cases with tiny models on the CPU (CI)
    benchmarks/gpu_check.sh                                   # the device runner: installs carried wheels, runs it

Each image case saves a pipeline directory whose denoiser has the real architecture of a published model (its
config from flowrl/plan_configs/, random weights, built on the GPU in bfloat16) and whose VAE has the real one
too; its text encoders are one- or two-layer models of the real width (the denoiser reads their width; their depth is
not the subject), with the tiny character tokenizers. The text case saves a random causal LM of Qwen2.5-1.5B's shape.
Then it runs flowrl itself on that directory: `flowrl.train.Trainer` built from the model's preset with a small
batch, two epochs of `Trainer.train_epoch` (the first warms the kernels and creates the AdamW states; the peaks
are the larger of the two, the rates the second's), and one checkpoint. Per case it reports:

  rollout GiB   the peak allocated while the epoch's rollout runs (torch.cuda.max_memory_allocated), against the
                plan's rollout figure (flowrl.plan.plan on the same config, the single-GPU column);
  update GiB    the peak while the update runs, against the plan's figure at the config's micro-batch and checkpointing;
  images/s      rollout images per second, and update samples per second (the second epoch);
  ratio_first   the first minibatch's importance ratio of the first epoch (GRPO: 1 on policy).
The case sd35m-grpo-compile is sd35m-grpo with `rollout.acceleration=[compile]` (the rollout's repeated blocks
compiled; the second epoch's rate is the compiled one), on a GPU only.

--tiny runs the same code on the CPU (float32, tiny models built from code, 32 px): the peak there is the live
tensors' (benchmarks/memory.py's LiveTensorBytes) on top of the weights, optimizer states and EMA. It keeps the pack
from rotting between GPU runs; its figures are not the subject. Writes gpu_check.json and gpu_check.md in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
GIB = 2**30


@dataclass(frozen=True)
class ImageModel:
    family: str  # flowrl's family name (its tiny pipeline gives the tokenizers and scheduler)
    plan_config: str  # file in flowrl/plan_configs/: the real denoiser, VAE and text encoder widths
    preset: str  # the config the case starts from


@dataclass(frozen=True)
class TextModel:
    config: dict  # a Qwen2 config


#: Qwen2.5-1.5B's shape (its published config.json)
QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_QWEN = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)

MODELS = {
    "sd35m": ImageModel("sd3", "stabilityai--stable-diffusion-3.5-medium.json", "configs/sd35m_pickscore.yaml"),
    "flux1-dev": ImageModel("flux", "black-forest-labs--FLUX.1-dev.json", "configs/flux_dev_pickscore.yaml"),
    "qwen2.5-1.5b": TextModel(QWEN25_15B),
}


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a key of MODELS
    objective: str = "grpo"
    prompts: int = 2  # sample.prompts_per_epoch
    group: int = 4  # sample.group_size
    checkpointing: bool = False
    micro: int = 4  # train.micro_batch_size (the minibatch is the epoch's batch: one optimizer step)
    steps: int = 10  # sample.num_steps (image)
    size: int = 512
    new_tokens: int = 256  # text.max_new_tokens (text)
    extra: tuple[str, ...] = ()
    gpu_only: bool = False  # left out of --tiny (compiling costs minutes on a CPU; tests/ compile a tiny model once)


CASES = [
    Case("sd35m-grpo", "sd35m"),
    Case("sd35m-nft", "sd35m", objective="nft"),
    # torch.compile of the repeated blocks for the rollout (lossless): beside sd35m-grpo, the same config
    Case("sd35m-grpo-compile", "sd35m", extra=("rollout.acceleration=[compile]",), gpu_only=True),
    # ... and kept compiled for the update (the rollout's and the update's kernels both the compiler's)
    Case(
        "sd35m-grpo-compile-update",
        "sd35m",
        extra=("rollout.acceleration=[{name: compile, update: true}]",),
        gpu_only=True,
    ),
    Case("flux1-dev-grpo-ckpt", "flux1-dev", prompts=1, group=4, checkpointing=True, micro=2, steps=6),
    Case("flux1-dev-nft-ckpt", "flux1-dev", objective="nft", prompts=1, group=4, checkpointing=True, micro=2, steps=6),
    Case("qwen2.5-1.5b-grpo", "qwen2.5-1.5b", prompts=4, group=4, micro=8),
]


# ------------------------------------------------------------------------------------------ memory per phase


class CudaPeaks:
    """Per phase: the peak of torch.cuda.max_memory_allocated while it runs (bytes), the phase's own wall time
    measured after a synchronize."""

    def __init__(self):
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str, trainer):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())


class LivePeaks:
    """On the CPU: the live tensors' peak during the phase (LiveTensorBytes) on top of the weights, optimizer states
    and EMA alive when it starts."""

    def __init__(self):
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str, trainer):
        from memory import LiveTensorBytes, storage_bytes

        modules = [trainer.policy.model] if trainer.cfg.backend == "text" else []
        if not modules:
            modules = [m for m in trainer.policy.backend.pipe.components.values() if isinstance(m, torch.nn.Module)]
        tensors = [t for m in modules for t in [*m.parameters(), *m.buffers()]]
        tensors += [v for state in trainer.opt.state.values() for v in state.values()]
        tensors += list(trainer.ema.shadow.values()) if trainer.ema else []
        static = storage_bytes(tensors)
        with LiveTensorBytes() as tracker:
            yield
        self.peaks[name] = max(self.peaks.get(name, 0), static + tracker.peak)


class MeasuredTimer:
    """The trainer's Timer (flowrl.run.metrics.Timer: `with timer(name)`, `pop()`) with a memory meter inside each
    phase, so that flowrl's own epoch is measured as it runs."""

    def __init__(self, timer, meter, trainer):
        self.timer, self.meter, self.trainer = timer, meter, trainer

    @contextlib.contextmanager
    def __call__(self, name: str):
        with self.timer(name), self.meter.phase(name, self.trainer):
            yield

    def pop(self):
        return self.timer.pop()


# ------------------------------------------------------------------------------------------ the models


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _text_encoder(component, tokenizer, real: dict):
    """A one- or two-layer text encoder of `component`'s class with the real model's width (`real`: its config.json)
    over the tiny character tokenizer."""
    from flowrl.families import _tiny as tiny

    if real["model_type"] == "t5":
        return tiny.t5_encoder(tokenizer, d_model=real["d_model"])
    config = tiny.clip_config(tokenizer, hidden=real["hidden_size"], projection=real.get("projection_dim", 32))
    config.max_position_embeddings = real["max_position_embeddings"]
    config.num_attention_heads = real["num_attention_heads"]
    return type(component)(config)


def save_image_model(model: ImageModel, directory: Path, *, tiny: bool, device: str, dtype: torch.dtype) -> None:
    """The family's tiny pipeline, or (not tiny) the same with the real denoiser, VAE and text encoder widths of
    `model.plan_config`, random weights, saved to `directory`."""
    import diffusers

    from flowrl.families import tiny_pipeline

    pipe = tiny_pipeline(f"tiny-{model.family}")
    if not tiny:
        real = json.loads((ROOT / "flowrl" / "plan_configs" / model.plan_config).read_text())
        torch.manual_seed(0)
        for name, component in list(pipe.components.items()):
            if name.startswith("text_encoder") and component is not None:
                tokenizer = pipe.components[name.replace("text_encoder", "tokenizer")]
                if real[f"{name}/config.json"]["model_type"] == "clip_text_model":
                    tokenizer.model_max_length = real[f"{name}/config.json"]["max_position_embeddings"]
                setattr(pipe, name, _text_encoder(component, tokenizer, real[f"{name}/config.json"]).eval())
        for name in ("transformer", "vae"):
            config = {k: v for k, v in real[f"{name}/config.json"].items() if not k.startswith("_")}
            with torch.device(device), default_dtype(dtype):  # a 12B denoiser is built in seconds on the GPU
                module = getattr(diffusers, real[f"{name}/config.json"]["_class_name"])(**config)
            setattr(pipe, name, module.eval())
    pipe.save_pretrained(directory)
    del pipe


def save_text_model(model: TextModel, directory: Path, *, tiny: bool, device: str, dtype: torch.dtype) -> None:
    """A random Qwen2 causal LM (the real shape, or a tiny one) with samples/arith's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**(TINY_QWEN if tiny else model.config), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device), default_dtype(dtype):
        Qwen2ForCausalLM(config).save_pretrained(directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "samples" / "arith" / file, directory / file)


# ------------------------------------------------------------------------------------------ one case


def case_config(case: Case, directory: Path, work: Path, *, tiny: bool, device: str):
    from flowrl.config import load_config

    model = MODELS[case.model]
    common = [
        f"model.path={directory}",
        f"model.device={device}",
        f"model.dtype={'float32' if tiny else 'bfloat16'}",
        f"train.objective={case.objective}",
        "train.epochs=2",
        "train.minibatch_size=0",
        f"train.micro_batch_size={case.micro}",
        f"train.gradient_checkpointing={str(case.checkpointing).lower()}",
        f"sample.prompts_per_epoch={case.prompts}",
        f"sample.group_size={case.group}",
        "eval.before=false",
        "eval.every=0",
        "checkpoint.every=0",
        "log.progress=false",
        "log.tensorboard=false",
        "log.completions_every=0",
        f"log.run_dir={work / case.name}",
        "log.overwrite=true",
    ]
    if isinstance(model, TextModel):
        arith = ROOT / "samples" / "arith"
        overrides = [
            "backend=text",
            f"text.max_new_tokens={8 if tiny else case.new_tokens}",
            "text.chat_template=false",
            "lora.rank=64",
            f"data.train_prompts={arith / 'train.jsonl'}",
            f"data.eval_prompts={arith / 'test.jsonl'}",
            "rewards=[{name: accuracy}]",
        ]
        return load_config(None, [*overrides, *common, *case.extra])
    size = 32 if tiny else case.size
    overrides = [
        f"sample.height={size}",
        f"sample.width={size}",
        f"sample.num_steps={2 if tiny else case.steps}",
        f"sample.max_sequence_length={16 if tiny else 128}",
        "rewards=[{name: jpeg_compressibility}]",
    ]
    return load_config(str(ROOT / model.preset), [*overrides, *common, *case.extra])


def planned(cfg, batch=None) -> dict:
    """The plan's figures for `cfg` on one GPU (GiB): the single-GPU column's update peak and rollout peak. A text
    run is planned at the prompt length its batch had (the planner otherwise assumes text.max_prompt_length)."""
    from flowrl.plan import plan

    if cfg.backend == "text" and batch is not None:
        prompt_tokens = batch.input_ids.shape[1] - cfg.text.max_new_tokens
        cfg = replace(cfg, text=replace(cfg.text, max_prompt_length=prompt_tokens))
    estimate = plan(cfg, gpus=1, gpu_memory_gib=1000.0)  # a large GPU: the figures, not the verdict
    column = next(c.title for c in estimate.columns if not c.shards and not c.offload)
    return dict(
        column=column,
        update_gib=estimate.fits[column].configured_gib,
        rollout_gib=estimate.rollout_fits[column][0],
    )


def run_case(case: Case, directory: Path, work: Path, *, tiny: bool, device: str) -> dict:
    """flowrl's Trainer on `directory`: two epochs measured phase by phase, then a checkpoint."""
    from flowrl.train import Trainer

    cfg = case_config(case, directory, work, tiny=tiny, device=device)
    meter = CudaPeaks() if device.startswith("cuda") else LivePeaks()
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    load_s = time.perf_counter() - t0
    trainer.timer = MeasuredTimer(trainer.timer, meter, trainer)
    batches = []  # the epochs' rollouts (a text run is planned at their prompt length)

    def keep_batch(*args, rollout=trainer.rollout, **kwargs):
        batches.append(rollout(*args, **kwargs))
        return batches[-1]

    trainer.rollout = keep_batch
    epochs = []
    for epoch in range(2):
        metrics = trainer.train_epoch(epoch)
        epochs.append(metrics)
    t0 = time.perf_counter()
    trainer.save()
    save_s = time.perf_counter() - t0
    plan_figures = planned(cfg, batches[-1])
    last, batch = epochs[-1], trainer.batch_total
    row = dict(
        case=case.name,
        objective=case.objective,
        backend=cfg.backend,
        images=batch,
        checkpointing=case.checkpointing,
        micro_batch=case.micro,
        load_s=load_s,
        checkpoint_s=save_s,
        rollout_gib=meter.peaks["rollout"] / GIB,
        update_gib=meter.peaks["train"] / GIB,
        planned_rollout_gib=plan_figures["rollout_gib"],
        planned_update_gib=plan_figures["update_gib"],
        plan_column=plan_figures["column"],
        rollout_per_s=batch / last["time/rollout"],
        update_per_s=batch / last["time/train"],
        reward_s=last["time/reward"],
        ratio_first=epochs[0].get("policy/ratio_first"),
        trained_units=last.get("policy/trained_units"),
        loss=last.get("policy/loss", last.get("loss")),
    )
    row["rollout_ratio"] = row["planned_rollout_gib"] / row["rollout_gib"]
    row["update_ratio"] = row["planned_update_gib"] / row["update_gib"]
    del trainer
    return row


# ------------------------------------------------------------------------------------------ the report


def environment(device: str) -> dict:
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "diffusers", "transformers", "accelerate", "peft", "safetensors"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = "-"
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    return dict(date=time.strftime("%Y-%m-%d"), device=gpu, python=platform.python_version(), **versions)


def markdown(env: dict, rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{env['date']}, {env['device']}; torch {env['torch']}, diffusers {env['diffusers']}, transformers "
        f"{env['transformers']}, peft {env['peft']}.",
        "",
        "| case | batch | micro | ckpt | rollout GiB (plan, ratio) | update GiB (plan, ratio) | rollout /s | "
        "update /s | ratio_first | load s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} |||||||||")
            continue
        lines.append(
            f"| {r['case']} | {r['images']} | {r['micro_batch']} | {'on' if r['checkpointing'] else 'off'} "
            f"| {r['rollout_gib']:.3g} ({r['planned_rollout_gib']:.3g}, {r['rollout_ratio']:.2f}) "
            f"| {r['update_gib']:.3g} ({r['planned_update_gib']:.3g}, {r['update_ratio']:.2f}) "
            f"| {r['rollout_per_s']:.2f} | {r['update_per_s']:.2f} | {num(r['ratio_first'], '.6f')} "
            f"| {r['load_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def run_cases(cases: list[Case], tmp: Path, *, tiny: bool, device: str, on_row) -> None:
    """Each case in this process (its model saved to `tmp` once, one model on disk at a time); `on_row(row)` after
    each, a failed case's row holding its error (the other cases still run)."""
    saved: dict[str, Path] = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            if case.model not in saved:
                for old in saved.values():
                    shutil.rmtree(old, ignore_errors=True)
                saved = {case.model: tmp / case.model}
                model = MODELS[case.model]
                save = save_text_model if isinstance(model, TextModel) else save_image_model
                save(model, saved[case.model], tiny=tiny, device=device, dtype=torch.bfloat16)
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            row = run_case(case, saved[case.model], tmp / "runs", tiny=tiny, device=device)
        except Exception as exc:
            traceback.print_exc()
            row = dict(case=case.name, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        row["seconds"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
        on_row(row)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def run_isolated(cases: list[Case], tmp: Path, on_row, *, tiny: bool = False) -> None:
    """On a GPU each model's cases run in a process of their own, so that a CUDA fault (which leaves the process's
    context unusable) costs only the cases of that model that had not finished."""
    import subprocess

    for model in dict.fromkeys(c.model for c in cases):
        mine = [c for c in cases if c.model == model]
        rows_file = tmp / f"rows-{model}.jsonl"
        command = [sys.executable, __file__, "--child", str(rows_file), "--work", str(tmp), "--out", str(tmp)]
        command += ["--tiny"] if tiny else []
        rc = subprocess.run([*command, "--cases", *(c.name for c in mine)]).returncode
        done = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
        for row in done:
            on_row(row)
        for case in mine[len(done) :]:
            on_row(dict(case=case.name, error=f"its process ended (rc {rc}) before the case finished: see the log"))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the CI run of this pack)")
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--cases", nargs="+", default=None, choices=[c.name for c in CASES], help="a subset (default all)")
    ap.add_argument("--work", default=None, help="folder for the saved models (default: /dev/shm if roomy, else tmp)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads with --tiny")
    ap.add_argument(
        "--isolate", action="store_true", help="each model's cases in a process of their own (on a GPU: always)"
    )
    ap.add_argument(
        "--save-model",
        nargs=2,
        metavar=("MODEL", "DIR"),
        default=None,
        help=f"only save MODEL ({', '.join(MODELS)}) with random weights to DIR (for benchmarks/rollout.py), then stop",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run_isolated's: append rows to this file
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    if args.tiny:
        torch.set_num_threads(args.threads)
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        raise SystemExit("gpu_check: no CUDA device here; run with --tiny for the CPU version")
    if args.save_model:
        name, directory = args.save_model
        if name not in MODELS:
            raise SystemExit(f"gpu_check: unknown model {name!r}; the models: {', '.join(MODELS)}")
        save = save_text_model if isinstance(MODELS[name], TextModel) else save_image_model
        save(MODELS[name], Path(directory), tiny=args.tiny, device=device, dtype=torch.bfloat16)
        return []
    cases = [c for c in CASES if (args.cases is None or c.name in args.cases) and not (args.tiny and c.gpu_only)]
    if args.child:
        rows_file = Path(args.child)
        with rows_file.open("a") as f:
            run_cases(
                cases,
                Path(args.work),
                tiny=args.tiny,
                device=device,
                on_row=lambda r: print(json.dumps(r), file=f, flush=True),
            )
        return []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    print(json.dumps(env), flush=True)
    base = args.work or ("/dev/shm" if shutil.disk_usage("/dev/shm").free > 60 * GIB and not args.tiny else None)
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(row)
        (out / "gpu_check.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
        (out / "gpu_check.md").write_text(markdown(env, rows))

    with tempfile.TemporaryDirectory(prefix="flowrl-gpu-check-", dir=base) as tmp:
        if device == "cuda" or args.isolate:
            run_isolated(cases, Path(tmp), on_row, tiny=args.tiny)
        else:
            run_cases(cases, Path(tmp), tiny=args.tiny, device=device, on_row=on_row)
    print(markdown(env, rows))
    return rows


if __name__ == "__main__":
    rows = main()
    sys.exit(1 if any("error" in r for r in rows) else 0)
