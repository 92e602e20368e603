"""`flowrl plan CONFIG`: will this config fit on these GPUs? A memory estimate made before renting them.

    from flowrl.config import load_config
    from flowrl.plan import plan
    print(plan(load_config("configs/sd35m_pickscore.yaml"), gpus=8, gpu_memory_gib=80).render())

The models are built from their configuration files on the meta device (no weight is read or allocated), so
even a 20B denoiser plans in seconds on a laptop. Per GPU, in GiB, it reports:

- the weights of every component the pipeline keeps on the GPU (denoiser, text encoders, VAE, the safety
  checker a pipeline loads) and of the reward models, in their dtypes;
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
  the denoiser, then the VAE decoder; for a causal LM, generate()'s KV cache, then the old log-probs of the
  GPU's whole batch in one forward; and the largest batch the rollout fits.

Configurations come from (in this order): a tiny test model (`tiny-<family>`, built for real: it is tiny), a
local pipeline directory (model_index.json and each component's config.json), the JSON files shipped in
`flowrl/plan_configs/` for the hub models the presets use (written from their published config.json files),
or the hub itself through huggingface_hub (its cache, or a download unless HF_HUB_OFFLINE is set).

Every figure is an estimate. The activation model (`activation_bytes`) was calibrated against peaks measured
on a CPU (benchmarks/memory.py, with its live-tensor tracker) on mid-size random models (CALIBRATION says
which, with the numbers); it leaves out the CUDA context, kernel workspaces and allocator fragmentation, for
which `RESERVE_GIB` and `RESERVE_FRACTION` of each GPU are kept free.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from .errors import FlowrlError

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: kept free on every GPU: the CUDA context and kernel workspaces (RESERVE_GIB) and allocator fragmentation
#: (RESERVE_FRACTION of the memory)
RESERVE_GIB = 1.0
RESERVE_FRACTION = 0.05
SHIPPED_DIR = Path(__file__).with_name("plan_configs")
STRATEGIES = ("DDP", "FSDP", "offload")


class PlanError(FlowrlError, ValueError):
    """A model or config the planner cannot read: the message names it and what would work."""


# ------------------------------------------------------------------------------------ configuration files


def shipped_models() -> list[str]:
    """The hub ids whose configuration files ship with flowrl (flowrl/plan_configs/)."""
    ids = []
    for file in sorted(SHIPPED_DIR.glob("*.json")):
        with open(file, encoding="utf-8") as f:
            ids.append(json.load(f)["_hub_id"])
    return ids


def _shipped(repo_id: str) -> dict | None:
    file = SHIPPED_DIR / (repo_id.replace("/", "--") + ".json")
    if not file.is_file():
        return None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def config_reader(path: str) -> tuple[Callable[[str], dict], str]:
    """(read, source): `read(name)` returns the model's JSON file `name` ("model_index.json",
    "transformer/config.json", "config.json"); `source` says where they come from.

    path: a local directory, or a hub id: the JSON shipped in flowrl/plan_configs/ if there is one, else the
    hub's files through huggingface_hub (its cache, or downloaded unless HF_HUB_OFFLINE is set). A hub id
    with neither fails with a PlanError naming it."""
    if os.path.isdir(path):
        def read_local(name: str) -> dict:
            file = os.path.join(path, *name.split("/"))
            if not os.path.isfile(file):
                raise PlanError(f"{path} has no {name}: not a diffusers pipeline (pipe.save_pretrained(DIR)) or "
                                f"transformers model (model.save_pretrained(DIR)) directory")
            with open(file, encoding="utf-8") as f:
                return json.load(f)

        return read_local, f"local directory {path}"
    if os.path.exists(path):
        raise PlanError(f"model.path={path} is a file; a model is a directory or a hub id (ORG/NAME)")
    files = _shipped(path)
    if files is not None:
        def read_shipped(name: str) -> dict:
            if name not in files:
                raise PlanError(f"{path}: the shipped configuration (flowrl/plan_configs) has no {name}")
            return files[name]

        return read_shipped, "configuration shipped with flowrl (flowrl/plan_configs)"
    return (lambda name: _read_hub(path, name)), "the Hugging Face hub"


def _read_hub(repo_id: str, name: str) -> dict:
    from .families._loading import _hub_offline, _read_hub_json
    from .families import ImageModelError

    try:
        return _read_hub_json(repo_id, name)
    except ImageModelError as e:
        offline = " (HF_HUB_OFFLINE is set)" if _hub_offline() else ""
        raise PlanError(
            f"no configuration for model {repo_id!r}: flowrl ships none for it and the hub gave none{offline}: {e}. "
            f"Shipped: {', '.join(shipped_models())}; or point model.path to a local directory holding its "
            f"config files") from None


# ------------------------------------------------------------------------------------ models on the meta device


@dataclass
class Component:
    """One model of the pipeline (or a reward backbone) and its size."""

    name: str  # "transformer", "text_encoder_2", "reward pickscore"
    class_name: str
    params: int  # parameters + persistent buffers: what its checkpoint holds
    weight_bytes: int  # parameters + all buffers in `dtype`
    dtype: str
    module: torch.nn.Module | None = field(default=None, repr=False)


@contextlib.contextmanager
def _quiet():
    """Silence the libraries' warnings and info logs while building modules from configs."""
    loggers = [logging.getLogger(n) for n in ("transformers", "diffusers", "peft", "accelerate")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _model_class(library: str, class_name: str):
    """The class a model_index.json entry names, or None if it is not an nn.Module (a tokenizer, scheduler,
    image processor)."""
    import importlib

    modules = {"diffusers": "diffusers", "transformers": "transformers"}
    module_name = modules.get(library, f"diffusers.pipelines.{library}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        raise PlanError(f"model_index.json names {library}.{class_name}, which this diffusers/transformers install "
                        f"does not have: upgrade them, or plan a model they know") from None
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


def build_on_meta(cls, config: Mapping) -> torch.nn.Module:
    """An instance of the diffusers or transformers model class `cls` made from its config dict on the meta
    device: every tensor has its shape and dtype and no storage."""
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with _quiet(), torch.device("meta"):
        if hasattr(cls, "from_config") and hasattr(cls, "config_name"):  # diffusers ModelMixin
            return cls.from_config(config)
        config_class = getattr(cls, "config_class", None)
        if config_class is None:
            raise PlanError(f"cannot build {cls.__name__} from a config: neither a diffusers nor a transformers model")
        return cls._from_config(config_class(**config))


def _sizes(module: torch.nn.Module, dtype: str) -> tuple[int, int]:
    """(parameters + persistent buffers: what its checkpoint holds, bytes of the parameters and all buffers in
    `dtype`). Tied weights count once; integer buffers keep their own size."""
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values()}
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    params = sum(t.numel() for t in module.parameters()) + sum(
        t.numel() for t in module.buffers() if id(t) in persistent)
    nbytes = sum(t.numel() * (DTYPE_BYTES[dtype] if t.is_floating_point() else t.element_size())
                 for t in tensors.values())
    return params, nbytes


def pipeline_components(path: str, dtype: str, *, skip: tuple[str, ...] = ()) -> tuple[str, list[Component], str]:
    """(pipeline class, its models built on meta, where the configuration came from) for a diffusers pipeline:
    a tiny test model, a local directory, a shipped configuration or the hub. `skip`: components left out
    (drop_t5). A shipped or hub model's modules are built once per process and shared: copy one before
    changing it."""
    if os.path.isdir(path):
        return _pipeline_components(path, dtype, tuple(skip))
    return _cached_pipeline_components(path, dtype, tuple(skip))


@functools.lru_cache(maxsize=8)
def _cached_pipeline_components(path: str, dtype: str, skip: tuple[str, ...]):
    return _pipeline_components(path, dtype, skip)


def _pipeline_components(path: str, dtype: str, skip: tuple[str, ...]) -> tuple[str, list[Component], str]:
    from .families import tiny_models, tiny_pipeline

    if path in tiny_models() and not os.path.exists(path):
        with _quiet():
            pipe = tiny_pipeline(path)
        parts = []
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and name not in skip:
                params, nbytes = _sizes(module, dtype)
                parts.append(Component(name, type(module).__name__, params, nbytes, dtype, module))
        return type(pipe).__name__, parts, "tiny test model built in code"
    read, source = config_reader(path)
    index = read("model_index.json")
    pipeline_class = index.get("_class_name")
    pipeline_class = pipeline_class[-1] if isinstance(pipeline_class, list) else pipeline_class
    parts = []
    for name, entry in index.items():
        if name.startswith("_") or name in skip or not isinstance(entry, (list, tuple)) or entry[0] is None:
            continue
        cls = _model_class(*entry)
        if cls is None:
            continue
        module = build_on_meta(cls, read(f"{name}/config.json"))
        params, nbytes = _sizes(module, dtype)
        parts.append(Component(name, cls.__name__, params, nbytes, dtype, module))
    return pipeline_class, parts, source


def causal_lm(path: str, dtype: str) -> tuple[Component, str]:
    """(the causal LM of the text backend built on meta, where its config came from). A shipped or hub model is
    built once per process and shared: copy its module before changing it."""
    if os.path.isdir(path):
        return _causal_lm(path, dtype)
    return _cached_causal_lm(path, dtype)


@functools.lru_cache(maxsize=4)
def _cached_causal_lm(path: str, dtype: str) -> tuple[Component, str]:
    return _causal_lm(path, dtype)


def _causal_lm(path: str, dtype: str) -> tuple[Component, str]:
    import transformers

    read, source = config_reader(path)
    config = read("config.json")
    architectures = config.get("architectures") or []
    cls = next((getattr(transformers, a) for a in architectures if hasattr(transformers, a)), None)
    if cls is None:
        cls = transformers.AutoModelForCausalLM
        with _quiet():
            model_config = transformers.AutoConfig.for_model(**config)
            with torch.device("meta"):
                module = cls.from_config(model_config)
    else:
        module = build_on_meta(cls, config)
    params, nbytes = _sizes(module, dtype)
    return Component("model", type(module).__name__, params, nbytes, dtype, module), source


# ------------------------------------------------------------------------------------ token streams of a denoiser


@dataclass(frozen=True)
class Layout:
    """Which tokens each Linear/Conv layer of a denoiser class sees, by the layer's name (regexes, searched in
    this order): `one`: one vector per sample (timestep and pooled-text embeddings, adaLN modulation);
    `joint`: image and text tokens together (single-stream blocks); `txt`: the text tokens; anything else:
    the image tokens (for a UNet, those of the resolution level its name says). `blocks`: the modules that
    gradient checkpointing recomputes (diffusers checkpoints them one by one)."""

    blocks: str
    one: str
    txt: str
    joint: str = r"(?!)"
    unet: bool = False


_ADALN = r"norm1(_context)?\.linear|norm\.linear|norm_out\.linear"
LAYOUTS: dict[str, Layout] = {
    "SD3Transformer2DModel": Layout(
        blocks=r"transformer_blocks\.\d+", one=rf"time_text_embed|{_ADALN}",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context"),
    "FluxTransformer2DModel": Layout(
        blocks=r"(single_)?transformer_blocks\.\d+", one=rf"time_text_embed|{_ADALN}",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context", joint=r"single_transformer_blocks"),
    "Flux2Transformer2DModel": Layout(
        blocks=r"(single_)?transformer_blocks\.\d+", one=r"time_guidance_embed|modulation|norm_out\.linear",
        txt=r"context_embedder|attn\.add_|to_add_out|ff_context", joint=r"single_transformer_blocks"),
    "QwenImageTransformer2DModel": Layout(
        blocks=r"transformer_blocks\.\d+", one=r"time_text_embed|_mod\.|norm_out\.linear",
        txt=r"txt_|attn\.add_|to_add_out"),
    "ZImageTransformer2DModel": Layout(
        blocks=r"(layers|noise_refiner|context_refiner)\.\d+", one=r"t_embedder|adaLN_modulation",
        txt=r"cap_embedder|context_refiner", joint=r"^layers\."),
    "SanaTransformer2DModel": Layout(
        blocks=r"transformer_blocks\.\d+", one=r"time_embed", txt=r"caption_projection|attn2\.to_[kv]$"),
    "UNet2DConditionModel": Layout(  # diffusers checkpoints the resnets and the attentions' transformer blocks
        blocks=(r"(down_blocks\.\d+\.|up_blocks\.\d+\.|mid_block\.)"
                r"(resnets\.\d+|attentions\.\d+\.transformer_blocks\.\d+)"),
        one=r"time_embedding|time_emb_proj|add_embedding", txt=r"attn2\.to_[kv]$", unet=True),
}
#: the layout of a denoiser class not in LAYOUTS, from the names diffusers' transformers share
GENERIC_LAYOUT = Layout(blocks=r"(single_)?transformer_blocks\.\d+|layers\.\d+",
                        one=r"time|modulation|adaLN|norm_out\.linear|norm1(_context)?\.linear|norm\.linear",
                        txt=r"context|add_|txt|caption|cap_", joint=r"single_transformer_blocks")


@dataclass(frozen=True)
class Layer:
    """A Linear or Conv layer of the denoiser, for one model row: the tokens it sees (in and out; they differ
    for a UNet's down/up-samplers), its fan-in and fan-out, the block it belongs to (None: outside every
    checkpointed block) and its LoRA rank (0: not adapted)."""

    name: str
    stream: str  # "one", "joint", "txt", "img" or, in a UNet, "img<level>"
    tokens_in: int
    tokens_out: int
    fan_in: int
    fan_out: int
    block: str | None
    lora_rank: int = 0

    @property
    def units(self) -> int:
        """tokens x (fan-in + fan-out): the elements of this layer's input and output."""
        return self.tokens_in * self.fan_in + self.tokens_out * self.fan_out


def denoiser_layers(module: torch.nn.Module, class_name: str, *, image_tokens: int, text_tokens: int,
                    levels: int = 1, lora_targets: Mapping[str, int] | None = None) -> list[Layer]:
    """The Linear/Conv layers of a denoiser with the tokens each sees in one model row.

    image_tokens: the image tokens at the denoiser's input (for a UNet: latent height x width, level 0).
    text_tokens: the prompt embedding's tokens. levels: a UNet's resolution levels (len(block_out_channels)).
    lora_targets: name -> LoRA rank of the adapted layers."""
    layout = LAYOUTS.get(class_name, GENERIC_LAYOUT)
    lora_targets = lora_targets or {}
    layers = []
    for name, mod in module.named_modules():
        if ".lora_" in name:  # an adapter's own layers (counted by lora_cast_bytes)
            continue
        name = name.removesuffix(".base_layer")  # the layer a LoRA wraps
        if isinstance(mod, torch.nn.Linear):
            fan_in, fan_out = mod.in_features, mod.out_features
        elif isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            fan_in, fan_out = mod.in_channels, mod.out_channels
        else:
            continue
        block = re.match(rf"({layout.blocks})(\.|$)", name)
        block = block.group(1) if block else None
        if re.search(layout.one, name):
            stream, t_in, t_out = "one", 1, 1
        elif re.search(layout.joint, name):
            stream, t_in, t_out = "joint", image_tokens + text_tokens, image_tokens + text_tokens
        elif re.search(layout.txt, name):
            stream, t_in, t_out = "txt", text_tokens, text_tokens
        elif layout.unet:
            stream, t_in, t_out = _unet_tokens(name, image_tokens, levels)
        else:
            stream, t_in, t_out = "img", image_tokens, image_tokens
        layers.append(Layer(name, stream, t_in, t_out, fan_in, fan_out, block, lora_targets.get(name, 0)))
    return layers


def _unet_tokens(name: str, image_tokens: int, levels: int) -> tuple[str, int, int]:
    """(stream, tokens in, tokens out) of a UNet layer: level i of the down path has image_tokens / 4^i; up
    block i runs at level levels-1-i; a downsampler halves each side, an upsampler's conv runs after the
    doubling."""
    level = 0
    if m := re.match(r"down_blocks\.(\d+)", name):
        level = int(m.group(1))
    elif m := re.match(r"up_blocks\.(\d+)", name):
        level = levels - 1 - int(m.group(1))
    elif name.startswith("mid_block"):
        level = levels - 1
    tokens = max(1, image_tokens // 4**level)
    if ".downsamplers." in name:
        return f"img{level}", tokens, max(1, tokens // 4)
    if ".upsamplers." in name:
        return f"img{level - 1}", tokens * 4, tokens * 4
    return f"img{level}", tokens, tokens


# ------------------------------------------------------------------------------------ the activation model


@dataclass(frozen=True)
class Calibration:
    """The activation model's factors for one model class (see `activation_bytes`), and where they come from."""

    alpha: float  # bytes kept for the backward pass per unit (tokens x fan) of a layer, in units of the dtype
    kappa: float  # with checkpointing: bytes kept per element of a block's input, in units of the dtype
    rho: float  # with checkpointing: the recomputed block's bytes (its activations and its backward's) per unit
    measured: str  # where the numbers come from
    head: float = 0.0  # a causal LM's output head: bytes per token x vocabulary entry, in units of the dtype
    chunk: float = 0.0  # a causal LM's log-prob: float32 [rows, vocabulary] buffers of its row chunks
    gamma: float = 1.0  # the rollout without gradients: a denoiser's bytes per unit of its largest block and the
    #                     layers outside the blocks; a causal LM's per token x vocabulary entry of its logits
    gamma_chunk: float = 0.0  # a causal LM's rollout: float32 [rows, vocabulary] buffers of the log-prob's chunks


#: Set by `python benchmarks/memory.py --fit` on mid-size random models (CPU, bfloat16, LoRA r8 on the family's
#: targets, beta 0.01 with CFG at 256 px for images; LoRA r16 on peft's default, beta 0.04, 64 new tokens for text):
#: the measured activations (MiB, on top of the static memory) are listed for micro-batch 1 / 4 / 16 (text: 2 / 4 /
#: 8), without and with gradient checkpointing; with these factors the estimate is within the stated error of each.
#: Checked on models not used to fit them (estimate / measured activations, micro-batch 1 and 2, checkpointing
#: off and on): an SD3 of 12 blocks of 768 at 384 px (576 + 32 tokens) 0.99-1.00, a FLUX.1 of 4 + 8 blocks of 768
#: at 384 px 1.00-1.01, a UNet of 96 / 192 / 384 / 384 channels at 384 px 1.00-1.01, an SD3 of 4 blocks of 256 at
#: 128 px 0.98-1.02 (the test's). Classes without an entry use BORROWED or DEFAULT_CALIBRATION.
CALIBRATION: dict[str, Calibration] = {
    # SD3 of 8 blocks of 512 (dual attention in 4, qk RMS norm), 256 + 32 tokens: 133.4 / 527.6 / 2104.4 and
    # 27.2 / 103.1 / 406.4; of 24 blocks of 256 (dual attention in 13): 201.7 / 798.0 and 18.4 / 64.7 (micro 1 / 4).
    # Within 0.3% without checkpointing, 0.2% with it.
    # The rollout's denoiser (no gradients, 2 and 4 images with CFG): 15.7 / 31.4 MiB, gamma 0.513.
    "SD3Transformer2DModel": Calibration(0.970, 0.61, 1.17, "calibrated on measured SD3s of 8 x 512 and 24 x 256 "
                                                            "blocks (benchmarks/memory.py)", gamma=0.513),
    # FLUX.1 of 3 double + 6 single blocks of 512, 256 + 16 tokens: 54.7 / 213.9 / 850.8 and 12.6 / 46.2 / 180.5;
    # of 6 + 12 blocks of 256: 52.7 / 205.9 and 8.2 / 28.7. Within 2.5% without checkpointing, 0.8% with it.
    # The rollout's denoiser (2 and 4 images): 9.4 / 18.7 MiB, gamma 0.873.
    "FluxTransformer2DModel": Calibration(0.860, 1.00, 1.25, "calibrated on measured FLUX.1s of 3 + 6 x 512 and "
                                                             "6 + 12 x 256 blocks (benchmarks/memory.py)", gamma=0.873),
    # SD1.5's UNet at a fifth of its width (64 / 128 / 256 / 256 channels, 2 layers per block), 1024 latent pixels +
    # 16 tokens: 109.1 / 432.9 / 1728.5 and 26.1 / 101.2 / 401.6; with 1 layer per block: 68.6 / 272.2 and
    # 20.9 / 81.4 (micro 1 / 4). Within 1.1% without checkpointing, 0.1% with it.
    # The rollout's denoiser (2 and 4 images with CFG): 13.1 / 26.2 MiB, gamma 0.364.
    "UNet2DConditionModel": Calibration(0.941, 0.59, 1.00, "calibrated on measured SD1.5-style UNets of 1 and 2 "
                                                           "layers per block (benchmarks/memory.py)", gamma=0.364),
    # causal LMs (Qwen2, ~69 tokens): 4 layers of 256 with a 151,936 vocabulary: 313.1 / 498.7 / 742.4 and
    # 307.1 / 486.6 / 718.2; 8 layers of 512, vocabulary 1,024: 27.7 / 55.4 / 110.9 and 6.1 / 12.2 / 24.4; 24 layers
    # of 256: 41.1 / 82.2 / 164.3 and 4.2 / 8.4 / 16.9 (micro 2 / 4 / 8). Over micro-batch 1 to 16 (the benchmark's
    # default run) within 14% without checkpointing (at micro-batch 1 the logits' slice is contiguous and the
    # log-prob makes one copy fewer) and 19% with it.
    # The rollout (generate, then the old log-probs of 2 / 4 / 8 completions in one forward), vocabulary 151,936:
    # 205.8 / 284.0 / 440.5 MiB: 39.1 MiB per completion = 1.95 x its bf16 logits (they and the copy the log-prob
    # makes of their slice) and 128 MiB once = 2 float32 row chunks of 2^24 elements; within 2% up to 16
    # completions. With a 1,024 vocabulary the hidden states, left out, matter: 32% under.
    "causal LM": Calibration(0.849, 0.52, 1.42, "calibrated on measured Qwen2s of 4 x 256 (vocabulary 151,936), "
                                                "8 x 512 and 24 x 256 layers (benchmarks/memory.py)",
                             head=3.437, chunk=2.714, gamma=1.95, gamma_chunk=2.0),
}
DEFAULT_CALIBRATION = Calibration(alpha=1.0, kappa=1.5, rho=1.5, head=4.0, chunk=3.0,
                                  measured="not calibrated: the factors are a guess from the calibrated classes")
#: denoiser classes not measured yet, and the measured class whose blocks theirs resemble most
BORROWED = {
    "QwenImageTransformer2DModel": "FluxTransformer2DModel",  # double-stream blocks with RoPE, as FLUX.1's
    "Flux2Transformer2DModel": "FluxTransformer2DModel",  # double- then single-stream blocks
    "ZImageTransformer2DModel": "FluxTransformer2DModel",  # single-stream blocks over image and text tokens
}


def calibration(class_name: str) -> Calibration:
    """The activation factors of a model class: its own (CALIBRATION), a similar class's (BORROWED), or the
    DEFAULT_CALIBRATION guess; `measured` says which."""
    if class_name in CALIBRATION:
        return CALIBRATION[class_name]
    if class_name in BORROWED:
        return dataclasses.replace(CALIBRATION[BORROWED[class_name]],
                                   measured=f"not measured: {BORROWED[class_name]}'s factors (similar blocks); run "
                                            f"benchmarks/memory.py on a {class_name} to calibrate it")
    return DEFAULT_CALIBRATION


class ActivationTerms(NamedTuple):
    """The shape terms of the activation model for one model row (see `activation_bytes`)."""

    units: int  # sum over the layers of tokens x (fan-in + fan-out)
    units_checkpointed: int  # the same over the largest block and the layers outside every block
    kept: int  # sum over the blocks of their input's elements (what checkpointing keeps)
    lora: float  # bytes LoRA adds (lora_cast_bytes) over all layers
    lora_checkpointed: float  # the same over the largest block and the layers outside every block


def lora_cast_bytes(layer: Layer, dtype: str) -> float:
    """What a LoRA adapter adds to the saved activations of its layer: peft casts the layer's input to the
    adapter's float32 (a copy, kept for lora_A's backward, when the model is not float32) and keeps lora_A's
    float32 output for lora_B's backward."""
    if not layer.lora_rank:
        return 0.0
    cast = layer.tokens_in * layer.fan_in * 4 if dtype != "float32" else 0
    return cast + layer.tokens_in * layer.lora_rank * 4


def activation_terms(layers: list[Layer], dtype: str) -> ActivationTerms:
    """The shape terms of `layers` (one model row). A block's input is, per token stream it holds, the input
    of the stream's first layer: the hidden states diffusers' checkpointing keeps."""
    blocks: dict[str | None, list[Layer]] = {}
    for layer in layers:
        blocks.setdefault(layer.block, []).append(layer)
    outside = blocks.pop(None, [])
    units = lambda group: sum(layer.units for layer in group)  # noqa: E731
    lora = lambda group: sum(lora_cast_bytes(layer, dtype) for layer in group)  # noqa: E731
    kept = 0
    for group in blocks.values():
        first: dict[str, int] = {}
        for layer in group:
            if layer.stream != "one":
                first.setdefault(layer.stream, layer.tokens_in * layer.fan_in)
        kept += sum(first.values())
    largest = max(blocks.values(), key=units, default=[])
    return ActivationTerms(units(layers), units(largest) + units(outside), kept, lora(layers),
                           lora(largest) + lora(outside))


@dataclass(frozen=True)
class Activations:
    """The update's activation memory (bytes) of one model row, in the pieces the peak is made of. plain: what
    the backward pass needs without checkpointing; with it, the blocks' inputs (`kept`) stay while one block
    at a time is recomputed (`recompute`, with the layers outside the blocks), and a causal LM's output head
    (`head`) is done with before the first block is recomputed."""

    plain: float
    kept: float
    recompute: float
    head: float = 0.0
    calibrated: bool = True

    @property
    def checkpointed(self) -> float:
        return min(self.plain, self.kept + max(self.recompute, self.head))


def activation_bytes(terms: ActivationTerms, class_name: str, dtype: str, head_units: int = 0) -> Activations:
    """The activations one model row keeps for the backward pass (b: the dtype's size):

        plain        = alpha x b x units + LoRA + head
        checkpointed = kappa x b x kept + max(rho x b x units_checkpointed + LoRA_checkpointed, head)

    units: sum over the layers of tokens x (fan-in + fan-out); kept: the blocks' inputs, which checkpointing
    keeps while it recomputes one block at a time and runs its backward (rho: that block's activations and
    its backward's temporaries, with the layers outside the blocks; see ActivationTerms); head = head_factor
    x b x head_units, a causal LM's output head (tokens x vocabulary: the logits the log-probs keep and their
    gradients), done with before the first block is recomputed. The factors are per model class (CALIBRATION)."""
    cal = calibration(class_name)
    b = DTYPE_BYTES[dtype]
    head = cal.head * b * head_units
    return Activations(plain=cal.alpha * b * terms.units + terms.lora + head, kept=cal.kappa * b * terms.kept,
                       recompute=cal.rho * b * terms.units_checkpointed + terms.lora_checkpointed, head=head,
                       calibrated=class_name in CALIBRATION)


def inject_lora(module: torch.nn.Module, rank: int, alpha: float, targets, *, causal_lm: bool = False
                ) -> tuple[torch.nn.Module, dict[str, int]]:
    """(the module with LoRA adapters, as flowrl's policies add them; the adapted layers' names -> rank).
    targets: module names (peft's matching) or None for peft's default of a causal LM's model type."""
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             task_type="CAUSAL_LM" if causal_lm else None)
    with _quiet():
        try:
            if causal_lm:
                module = peft.get_peft_model(module, config)
            else:
                module = peft.inject_adapter_in_model(config, module)
        except ValueError as e:
            raise PlanError(f"lora.target_modules {list(targets) if targets else 'default'}: peft adapts nothing "
                            f"in {type(module).__name__} ({e})") from None
    adapted = {}
    for name, mod in module.named_modules():
        if isinstance(mod, BaseTunerLayer) and mod.r:
            adapted[name.removeprefix("base_model.model.")] = next(iter(mod.r.values()))
    return module, adapted


def lora_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if "lora_" in n)


# ------------------------------------------------------------------------------------ what the config asks


def _vae_factor_and_channels(vae: Mapping) -> tuple[int, int]:
    """(spatial downsampling factor, latent channels) of a VAE config."""
    cls = vae.get("_class_name", "AutoencoderKL")
    if cls in ("AutoencoderKLQwenImage", "AutoencoderKLWan"):
        return 2 ** len(vae.get("temperal_downsample", [False, True, True])), vae.get("z_dim", 16)
    if cls == "AutoencoderDC":
        return 2 ** (len(vae["encoder_block_out_channels"]) - 1), vae.get("latent_channels", 32)
    return 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1), vae.get("latent_channels", 4)


def latent_frames(vae: Mapping, num_frames: int) -> int:
    """The latent frames of a clip of `num_frames` frames: a video VAE (AutoencoderKLWan) compresses time by
    2^(its temporal downsamplings) after the first frame, F' = (F - 1) / 2^k + 1; an image VAE keeps F."""
    if vae.get("_class_name") == "AutoencoderKLWan":
        return (num_frames - 1) // 2 ** sum(bool(d) for d in vae.get("temperal_downsample", [False, True, True])) + 1
    return num_frames


def _config_dict(module) -> dict:
    return {"_class_name": type(module).__name__, **dict(module.config)} if module is not None else {}


@dataclass(frozen=True)
class ImageShape:
    """The update's shapes: tokens per model row, latent elements per sample, text-embedding size; with
    conditioning images (`ImageBackend.condition_tokens`) their tokens are among the image and text tokens, and
    `condition_elements` is what a sample keeps of them (their latents, or a condition in the latents' channels)."""

    image_tokens: int
    text_tokens: int
    levels: int
    latent_elements: int
    text_width: int
    frames: int = 1
    condition_elements: int = 0
    sources: int = 0


def image_shape(components: Mapping[str, Component], denoiser_attr: str, height: int, width: int,
                max_sequence_length: int, num_frames: int = 1, family=None, max_sources: int | None = None
                ) -> ImageShape:
    """The token counts of a denoiser row at height x width (x num_frames: a video's latent frames times its
    patches), from the denoiser's and the VAE's configs; the text tokens per denoiser class (SD3: CLIP's 77 then
    the T5 tokens; a UNet: the CLIP encoder's length; Wan image-to-video: its CLIP image tokens too; the others:
    `sample.max_sequence_length`, an upper bound where the pipeline drops the padding). `family` (an ImageBackend
    class) adds its conditioning images' tokens: `max_sources` of them (the most a prompt of the data holds), or
    when that is unknown (None) the most the family takes (`condition_images`)."""
    den = components[denoiser_attr].module
    config = _config_dict(den)
    vae = _config_dict(components["vae"].module) if "vae" in components else {}
    factor, latent_channels = _vae_factor_and_channels(vae) if vae else (8, config.get("in_channels", 4))
    in_channels = config.get("in_channels", latent_channels)
    patch = config.get("patch_size") or (config.get("all_patch_size") or [1])[0]
    pt, ph, pw = (tuple(patch) if isinstance(patch, (list, tuple)) and len(patch) == 3 else
                  (1, *(tuple(patch) if isinstance(patch, (list, tuple)) else (patch, patch))))
    packed = in_channels == 4 * latent_channels  # latents packed 2x2 by the pipeline (FLUX, Qwen-Image, FLUX.2)
    if packed:
        ph = pw = 2
    frames = latent_frames(vae, num_frames)
    cls = type(den).__name__

    def tokens_at(height: int, width: int, frames: int = 1) -> int:
        return -(-frames // pt) * ((height // factor) // ph) * ((width // factor) // pw)

    h, w = height // factor, width // factor
    clip = next((c.module.config.max_position_embeddings for n, c in components.items()
                 if n.startswith("text_encoder") and c.module is not None
                 and type(c.module).__name__.startswith("CLIPText")), 77)
    if cls == "SD3Transformer2DModel":
        text_tokens = clip + max_sequence_length
    elif cls == "UNet2DConditionModel":
        text_tokens = clip
    else:
        text_tokens = max_sequence_length
    encoder = components.get("image_encoder")
    if cls == "WanTransformer3DModel" and config.get("image_dim") and encoder is not None and encoder.module:
        vision = encoder.module.config  # its penultimate hidden states: the patches and the class token
        text_tokens += (vision.image_size // vision.patch_size) ** 2 + 1
    text_width = (config.get("joint_attention_dim") or config.get("cross_attention_dim")
                  or config.get("caption_channels") or config.get("cap_feat_dim") or config.get("text_dim") or 0)
    levels = len(config.get("block_out_channels", [0])) if cls == "UNet2DConditionModel" else 1
    image_tokens, elements = tokens_at(height, width, frames), latent_channels * frames * h * w
    if family is None:
        sources = 0
    else:
        low, high = family.condition_images
        sources = high if max_sources is None else min(high, max(low, max_sources))
    condition = 0
    if sources:
        source_image, source_text = family.condition_tokens(height, width, tokens_at)
        image_tokens += sources * source_image
        text_tokens += sources * source_text
        condition = sources * source_image * elements // max(1, tokens_at(height, width, frames))
    if in_channels > latent_channels and not packed:  # a condition concatenated to the latents' channels
        condition += (in_channels - latent_channels) * frames * h * w
    return ImageShape(image_tokens, text_tokens, levels, elements, int(text_width), frames, condition, sources)


def _prompt_file(spec: str, column: str) -> tuple[int | None, int | None]:
    """(prompts, the most conditioning images a prompt holds in `column`) of a local prompt file, in one read:
    prompts for a .txt or .jsonl file, images for a .jsonl one; None for what is not known (a `hf:` dataset, no
    such file, a .txt file's images, a .jsonl line that does not parse: the prompt loader names its problems)."""
    if not spec or spec.startswith("hf:") or not os.path.isfile(spec):
        return None, None
    from .conditioning import image_count

    prompts, most = 0, 0 if column and spec.endswith(".jsonl") else None
    with open(spec, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            prompts += 1
            if most is not None:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    most = None
                    continue
                most = max(most, image_count(row if isinstance(row, dict) else {}, column))
    return prompts, most


@functools.lru_cache(maxsize=16)
def _transformers_size(class_name: str, config_json: str, dtype: str) -> tuple[int, int]:
    import transformers

    return _sizes(build_on_meta(getattr(transformers, class_name), json.loads(config_json)), dtype)


def _held_component(label: str, who: str, held) -> tuple[list[Component], list[str]]:
    """One model a reward (or the eval feature backbone) keeps on the GPU, as it declares it (`rewards.memory`): a
    `HubModel` built on meta from its configuration, `Parameters` of a known count, or, for what cannot be sized
    (`NotEstimated`, no configuration, a model type it does not take), a note that starts with `who`."""
    import rewards

    if isinstance(held, rewards.NotEstimated):
        return [], [f"{who}: {held.reason}; its memory is not estimated"]
    if isinstance(held, rewards.Parameters):
        return [Component(label, held.what, held.count, held.count * DTYPE_BYTES[held.dtype], held.dtype)], []
    try:
        read, _ = config_reader(held.source)
        config = read("config.json")
    except PlanError:
        return [], [f"{who}: no configuration for {held.source}, its memory is not estimated"]
    try:
        class_name = held.class_for(config)
        params, nbytes = _transformers_size(class_name, json.dumps(config, sort_keys=True), held.dtype)
    except (ValueError, AttributeError) as e:  # a model type it does not take, a class transformers lacks
        return [], [f"{who}: {e}; its memory is not estimated"]
    return [Component(label, f"{class_name} {held.source}", params, nbytes, held.dtype)], []


def reward_components(specs) -> tuple[list[Component], list[str]]:
    """(the models the rewards keep on the GPU, built on meta as each reward declares them
    (`rewards.memory_spec`: a sum of rewards, its components'), notes on those whose memory is not estimated)."""
    import rewards

    parts, notes = [], []
    for spec in specs:
        try:
            held = rewards.memory_spec(spec.name, dict(spec.kwargs))
        except rewards.RewardConfigError as e:
            notes.append(f"reward {spec.name}: its memory is not estimated: {e}")
            continue
        for item in held:
            found, why = _held_component(f"reward {item.reward}", f"reward {item.reward}", item)
            parts, notes = parts + found, notes + why
    return parts, notes


def feature_components(backbone: str) -> tuple[list[Component], list[str]]:
    """The eval.diversity_features backbone built on meta (float32, as the trainer loads it; on the main process
    only) as `rewards.features.encoder_memory` describes it, or a note when its memory cannot be estimated.
    ("": none.)"""
    if not backbone:
        return [], []
    from rewards.features import encoder_memory

    return _held_component("eval.diversity_features, main process", "eval.diversity_features",
                           encoder_memory(backbone, "float32"))


# ------------------------------------------------------------------------------------ the plan


@dataclass
class Row:
    """One line of the plan: GiB per GPU under each strategy (None: not on the GPU under it)."""

    label: str
    params_b: float | None  # billions of parameters, where it is a model
    gib: dict[str, float | None]
    note: str = ""


@dataclass
class Fit:
    """One strategy's verdict. static: everything but the activations (GiB per GPU); per_sample: the activations
    of one micro-batch sample, without and with checkpointing; largest: the largest micro-batch that fits,
    without and with checkpointing (0: none); configured: the total at the config's micro-batch and
    checkpointing."""

    static_gib: float
    transient_gib: float
    per_sample_gib: dict[bool, float]
    largest: dict[bool, int]
    configured_gib: float
    fits: bool


@dataclass(frozen=True)
class UpdateEstimate:
    """The pieces of the update's estimate (bytes), for checking it against a measurement: the model rows per
    micro-batch sample, the activation terms of one row and their bytes, the gradients, and the transient
    after the backward pass (DDP)."""

    class_name: str
    dtype: str
    rows_per_sample: int
    terms: ActivationTerms
    activations: Activations
    grads: float
    transient: float  # DDP's
    head_units: int = 0  # a causal LM: tokens x vocabulary of its output head
    vocab: int = 0  # a causal LM: its vocabulary, and the completion tokens of a sample
    completion_tokens: int = 0

    def chunk_units(self, micro_batch: int) -> int:
        """A causal LM's log-prob row chunks: float32 elements of one [rows, vocabulary] buffer (flowrl.core's
        token_log_probs works in chunks of at most _CHUNK_FLOATS elements)."""
        if not self.vocab:
            return 0
        from .core.logprobs import _CHUNK_FLOATS

        return self.vocab * min(micro_batch * self.completion_tokens, max(1, _CHUNK_FLOATS // self.vocab))

    def chunk_bytes(self, micro_batch: int) -> float:
        return calibration(self.class_name).chunk * 4 * self.chunk_units(micro_batch)

    def activation_peak(self, micro_batch: int, checkpointing: bool) -> float:
        """The activations of a micro-batch at their peak (bytes); a causal LM's log-prob chunks come with its
        head."""
        a, rows, chunk = self.activations, micro_batch * self.rows_per_sample, self.chunk_bytes(micro_batch)
        plain = rows * a.plain + chunk
        if not checkpointing:
            return plain
        return min(plain, rows * a.kept + max(rows * a.recompute, rows * a.head + chunk))

    def dynamic(self, micro_batch: int, checkpointing: bool) -> float:
        """What the update allocates on top of the static memory: the gradients and the activations of a
        micro-batch (or the transient after the backward pass, if larger)."""
        return self.grads + max(self.activation_peak(micro_batch, checkpointing), self.transient)


@dataclass(frozen=True)
class RolloutEstimate:
    """The rollout's peak on top of the static memory: `items` images (completions) per call, and per phase
    (bytes per item, whether offload moves it off the GPU); the phases run one after another. `chunk(n)`: a
    causal LM's log-prob row chunks for n completions, in the old log-probs' phase."""

    items: int
    phases: dict[str, tuple[float, bool]]
    chunk: Callable[[int], float] = lambda n: 0.0

    def peak(self, items: int, strategy: str) -> float:
        return max((items * per + (self.chunk(items) if name == LOGITS_PHASE else 0.0)
                    for name, (per, offloaded) in self.phases.items() if not (offloaded and strategy == "offload")),
                   default=0.0)


LOGITS_PHASE = "old log-probs (logits)"


@dataclass
class Plan:
    """What `plan` found: the header facts, the memory rows, each strategy's verdict, notes."""

    facts: list[tuple[str, str]]
    rows: list[Row]
    activation_rows: list[Row]
    fits: dict[str, Fit]
    micro_batch: int
    minibatch: int
    checkpointing: bool
    gpus: int
    gpu_memory_gib: float
    host_gib: float  # CPU memory the offload strategy needs per GPU process
    update: UpdateEstimate
    rollout: RolloutEstimate
    rollout_fits: dict[str, tuple[float, bool, int]]  # strategy -> (GiB at the config, fits, largest items per call)
    notes: list[str] = field(default_factory=list)
    unit: str = "samples"  # what micro_batch and minibatch count: DPO's micro-batches count pairs

    def fits_as_configured(self, strategy: str) -> bool:
        """The config as it is, its update and its rollout, fits under `strategy`."""
        return self.fits[strategy].fits and self.rollout_fits[strategy][1]

    @property
    def usable_gib(self) -> float:
        return usable_gib(self.gpu_memory_gib)

    def render(self) -> str:
        """The plan as a text table (every memory figure in GiB per GPU; estimates, not measurements)."""
        width = max(44, *(len(r.label) + 2 for r in self.rows + self.activation_rows))
        out = ["flowrl plan: ESTIMATES (models built without weights; nothing was measured on a GPU)"]
        out += [f"{k:<9}{v}" for k, v in self.facts]
        out.append("")
        head = f"{'GiB per GPU':<{width}}{'params':>9}" + "".join(f"{s:>10}" for s in STRATEGIES)
        out += [head, "-" * len(head)]

        def line(row: Row) -> str:
            params = ("" if row.params_b is None else f"{row.params_b:.2f} B"
                      if row.params_b >= 0.01 or not row.params_b else f"{row.params_b * 1e3:.2f} M")
            cells = "".join(f"{'-' if row.gib[s] is None else _gib(row.gib[s]):>10}" for s in STRATEGIES)
            return f"{row.label:<{width}}{params:>9}{cells}" + (f"   {row.note}" if row.note else "")

        out += [line(r) for r in self.rows]
        out.append("-" * len(head))
        out.append(f"{'all but the activations':<{width}}{'':>9}"
                   + "".join(f"{_gib(self.fits[s].static_gib):>10}" for s in STRATEGIES))
        out += [line(r) for r in self.activation_rows]
        ckpt = "checkpointing" if self.checkpointing else "no checkpointing"
        out.append(f"{f'at micro-batch {self.micro_batch}, {ckpt} (the config)':<{width}}{'':>9}"
                   + "".join(f"{_gib(self.fits[s].configured_gib):>10}" for s in STRATEGIES))
        out.append(f"{'  fits in ' + _gib(self.usable_gib) + ' GiB usable?':<{width}}{'':>9}"
                   + "".join(f"{'yes' if self.fits[s].fits else 'NO':>10}" for s in STRATEGIES))
        for ck in (False, True):
            label = "largest micro-batch, " + ("checkpointing" if ck else "no checkpointing")
            cells = [self.fits[s].largest[ck] for s in STRATEGIES]
            cells = [f"all {self.minibatch}" if n >= self.minibatch else str(n) for n in cells]
            out.append(f"{label:<{width}}{'':>9}" + "".join(f"{c:>10}" for c in cells))
        out.append("-" * len(head))
        what = "images" if "denoiser" in self.rollout.phases else "completions"
        for name, (per, offloaded) in self.rollout.phases.items():
            out.append(line(Row(f"rollout, per {what[:-1]}: {name}", None,
                                {s: (None if offloaded and s == "offload" else per / GIB) for s in STRATEGIES})))
        out.append(f"{f'rollout of {self.rollout.items} {what} per call':<{width}}{'':>9}"
                   + "".join(f"{_gib(self.rollout_fits[s][0]):>10}" for s in STRATEGIES))
        out.append(f"{'  fits?':<{width}}{'':>9}"
                   + "".join(f"{'yes' if self.rollout_fits[s][1] else 'NO':>10}" for s in STRATEGIES))
        label = "largest sample.rollout_batch_size" if what == "images" else "largest completions per GPU"
        out.append(f"{label:<{width}}{'':>9}" + "".join(f"{self.rollout_fits[s][2]:>10}" for s in STRATEGIES))
        out.append("")
        out.append(f"usable = {self.gpu_memory_gib:g} GiB x {1 - RESERVE_FRACTION:g} - {RESERVE_GIB:g} GiB (CUDA "
                   f"context, workspaces, fragmentation). A micro-batch is at most the minibatch "
                   f"({self.minibatch} {self.unit} per GPU). offload keeps {_gib(self.host_gib)} GiB in CPU memory per "
                   f"GPU process.")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def _gib(gib: float) -> str:
    return f"{gib:.2f}" if gib >= 0.005 or gib == 0 else "<0.01"


def usable_gib(gpu_memory_gib: float) -> float:
    """What the plan lets the run use of a GPU of `gpu_memory_gib`."""
    return gpu_memory_gib * (1 - RESERVE_FRACTION) - RESERVE_GIB


def _verdicts(static: dict[str, float], transient: dict[str, float], activations: Callable[[int, bool], float],
              micro: int, checkpointing: bool, gpu_memory_gib: float) -> dict[str, Fit]:
    """Each strategy's Fit, from bytes: the peak of a micro-batch of m samples is
    static + max(activations(m, checkpointing), transient)."""
    budget = usable_gib(gpu_memory_gib) * GIB
    fits = {}
    for s in STRATEGIES:
        def peak(m: int, ck: bool) -> float:
            return static[s] + max(activations(m, ck), transient[s])

        largest = {}
        for ck in (False, True):
            lo, hi = 0, 1
            while hi <= 2**24 and peak(hi, ck) <= budget:
                lo, hi = hi, hi * 2
            while hi - lo > 1:  # lo fits (or is 0), hi does not
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if peak(mid, ck) <= budget else (lo, mid)
            largest[ck] = lo
        configured = peak(micro, checkpointing)
        per_sample = {ck: activations(1, ck) / GIB for ck in (False, True)}
        fits[s] = Fit(static[s] / GIB, transient[s] / GIB, per_sample, largest, configured / GIB, configured <= budget)
    return fits


def _batch_shape(cfg, gpus: int) -> tuple[int, int, int]:
    """(samples per GPU per epoch, minibatch, micro-batch) as the trainer splits them."""
    s, t = cfg.sample, cfg.train
    total = s.prompts_per_epoch * s.group_size
    if total % gpus:
        raise PlanError(f"the epoch batch {total} (sample.prompts_per_epoch x sample.group_size) does not split evenly "
                        f"over {gpus} GPUs: pick a GPU count that divides it")
    local = total // gpus
    minibatch = t.minibatch_size or local
    if local % minibatch:
        raise PlanError(f"train.minibatch_size={minibatch} does not divide the {local} samples per GPU of {gpus} GPUs: "
                        f"pick a GPU count or minibatch size that does")
    return local, minibatch, min(t.micro_batch_size or minibatch, minibatch)


def plan(cfg, *, gpus: int = 1, gpu_memory_gib: float = 80.0) -> Plan:
    """The memory plan of `cfg` (a flowrl Config) on `gpus` GPUs of `gpu_memory_gib` GiB each: the models are
    built on the meta device from their configuration files (see the module docstring); nothing is loaded."""
    if gpus < 1:
        raise PlanError(f"gpus must be >= 1, got {gpus}")
    if not gpu_memory_gib > 0:
        raise PlanError(f"gpu_memory_gib must be > 0, got {gpu_memory_gib}")
    if cfg.backend == "text":
        return _plan_text(cfg, gpus, gpu_memory_gib)
    return _plan_image(cfg, gpus, gpu_memory_gib)


def _family_of(path: str, requested: str):
    """The family backend class for model.path (a tiny model's name says it; otherwise its model_index.json)."""
    from .families import family, family_names, tiny_models

    if path in tiny_models() and not os.path.exists(path):
        fam = tiny_models()[path]
    else:
        read, _ = config_reader(path)
        cls = read("model_index.json").get("_class_name")
        cls = cls[-1] if isinstance(cls, list) else cls
        matches = [family(n) for n in family_names() if cls in family(n).pipeline_classes]
        if not matches:
            drives = ", ".join(f"{c} ({n})" for n in family_names() for c in family(n).pipeline_classes)
            raise PlanError(f"{path} is a {cls}, which no flowrl family drives in this install; supported "
                            f"pipelines: {drives}")
        fam = matches[0]
    if requested != "auto" and requested != fam.family:
        raise PlanError(f"model.family={requested} but {path} is a {fam.family!r} model: set model.family="
                        f"{fam.family} or auto")
    return fam


def _block_params(module: torch.nn.Module, blocks: str) -> int:
    """The parameters of the largest checkpointed block (what FSDP gathers at once)."""
    sizes: dict[str, int] = {}
    for name, p in module.named_parameters():
        if ".lora_" in name:
            continue
        m = re.match(rf"({blocks})\.", name)
        if m:
            sizes[m.group(1)] = sizes.get(m.group(1), 0) + p.numel()
    return max(sizes.values(), default=0)


@dataclass(frozen=True)
class _Training:
    """What the update trains and keeps besides the model, for `_training_rows`."""

    n_trained: int  # trained parameters
    lora_label: str | None  # "LoRA r32 on 191 layers" (their weights are extra), None: full fine-tuning
    dtype: str  # of the trained parameters and their gradients
    ema: bool
    reference: float | None  # bytes of a frozen reference copy (0: the adapter off), None: no reference pass
    gather: float  # bytes FSDP gathers at once (two blocks)
    optimizer: str = "adamw"  # train.optimizer

    @property
    def state_bytes(self) -> float:
        """The optimizer's two states per trained parameter: float32 (AdamW) or 8-bit (AdamW8bit)."""
        return (2 if self.optimizer == "adamw_8bit" else 8) * self.n_trained

    @property
    def master_bytes(self) -> float:
        """float32 master copies of trained weights that are not float32 (flowrl steps those in float32)."""
        return 0.0 if self.dtype == "float32" else 4 * self.n_trained

    def host_bytes(self) -> float:
        """What the offload strategy keeps in CPU memory for the update: the optimizer's states, float32 master
        weights of every trained parameter (the CPU step works on them), the EMA."""
        return self.state_bytes + 4 * self.n_trained + (4 * self.n_trained if self.ema else 0)


def _training_rows(tr: _Training, gpus: int) -> list[Row]:
    """The rows of the trained parameters, gradients, AdamW states, EMA, reference and FSDP's gathered blocks
    (bytes per GPU; FSDP shards all but the gathered blocks, offload moves AdamW and the EMA to the CPU)."""
    b = DTYPE_BYTES[tr.dtype]
    sharded = lambda v: {"DDP": v, "FSDP": v / gpus, "offload": v}  # noqa: E731
    in_cpu = lambda v: {"DDP": v, "FSDP": v / gpus, "offload": None}  # noqa: E731
    rows = []
    if tr.lora_label:
        rows.append(Row(f"{tr.lora_label} ({tr.dtype})", tr.n_trained / 1e9, sharded(tr.n_trained * b)))
    rows.append(Row(f"gradients ({tr.dtype})", None, sharded(tr.n_trained * b)))
    if tr.optimizer == "adamw_8bit":
        rows.append(Row("AdamW8bit states (2 x uint8)", None, in_cpu(tr.state_bytes)))
    else:
        rows.append(Row("AdamW states (2 x float32)", None, in_cpu(tr.state_bytes)))
    if tr.master_bytes:
        rows.append(Row("float32 master weights", None, in_cpu(tr.master_bytes)))
    if tr.ema:
        rows.append(Row("EMA of the trained parameters (float32)", None, in_cpu(4 * tr.n_trained)))
    if tr.reference is not None:
        label = "reference: a frozen copy" if tr.reference else "reference: the adapter off (no weights)"
        rows.append(Row(label, None, sharded(tr.reference)))
    rows.append(Row("FSDP: two blocks gathered at once", None, {"DDP": 0.0, "FSDP": tr.gather, "offload": 0.0}))
    return rows


def _finish(facts, rows: list[Row], update: UpdateEstimate, rollout: RolloutEstimate, tr: _Training, micro: int,
            minibatch: int, local: int, cfg, gpus: int, gpu_memory_gib: float, host_bytes: float, notes: list[str],
            rows_note: str, unit: str = "samples") -> Plan:
    """The Plan from its rows (bytes per GPU) and the update's and rollout's estimates: the verdicts, then
    everything in GiB."""
    t = cfg.train
    static = {k: sum(r.gib[k] or 0.0 for r in rows) for k in STRATEGIES}
    step = tr.state_bytes / 2  # AdamW's foreach step: a temporary the size of a state
    sync = update.grads if gpus > 1 else 0.0  # DDP's gradient buckets: a copy of the gradients
    transient = {"DDP": max(step, sync), "FSDP": step / gpus, "offload": sync}
    update = dataclasses.replace(update, transient=transient["DDP"])
    fits = _verdicts(static, transient, update.activation_peak, micro, t.gradient_checkpointing, gpu_memory_gib)
    per_sample = {False: update.rows_per_sample * update.activations.plain,
                  True: update.rows_per_sample * update.activations.checkpointed}
    for r in rows:
        r.gib = {k: (None if v is None else v / GIB) for k, v in r.gib.items()}
    activation_rows = [
        Row("activations / sample, no checkpointing", None, {k: per_sample[False] / GIB for k in STRATEGIES},
            rows_note),
        Row("activations / sample, checkpointing", None, {k: per_sample[True] / GIB for k in STRATEGIES}),
    ]
    if update.vocab:
        activation_rows.append(Row("log-prob row chunks (float32, at most)", None,
                                   {k: update.chunk_bytes(10**9) / GIB for k in STRATEGIES}))
    budget = usable_gib(gpu_memory_gib) * GIB
    rollout_fits = {}
    for k in STRATEGIES:  # the largest number of items per call that fits, up to the whole per-GPU batch
        fitting = [n for n in range(1, local + 1) if static[k] + rollout.peak(n, k) <= budget]
        at_config = static[k] + rollout.peak(rollout.items, k)
        rollout_fits[k] = (at_config / GIB, at_config <= budget, max(fitting, default=0))
    return Plan(facts, rows, activation_rows, fits, micro, minibatch, t.gradient_checkpointing, gpus,
                gpu_memory_gib, host_bytes / GIB, update, rollout, rollout_fits, notes, unit)


#: the VAE decoder without gradients: bytes per image per element of its full-resolution feature map (height x
#: width x the channels of the decoder's last block), in units of the dtype. Measured (benchmarks/memory.py,
#: measure_vae_decode) on SD3.5's VAE in bfloat16: 24.0 / 48.0 MiB for 1 / 2 images of 128 px, 162.0 MiB for
#: 3 of 192 px, 96.0 and 384.0 MiB for one of 256 and 512 px: 6.0 everywhere. FLUX.1's, SD1.5's and SDXL's
#: decoders have the same blocks; the other VAE classes' factor is this one, not measured.
VAE_DECODE_FACTOR = 6.0


def vae_decode_bytes(vae: Mapping, height: int, width: int, b: int) -> float | None:
    """The VAE decoder's peak for one image (bytes): VAE_DECODE_FACTOR x b x height x width x the channels of
    its full-resolution block. None for a VAE class whose decoder this does not know."""
    channels = {"AutoencoderKL": lambda c: (c.get("decoder_block_out_channels") or c["block_out_channels"])[0],
                "AutoencoderKLFlux2": lambda c: (c.get("decoder_block_out_channels") or c["block_out_channels"])[0],
                "AutoencoderKLQwenImage": lambda c: c.get("base_dim", 96),
                "AutoencoderDC": lambda c: c["decoder_block_out_channels"][0]}.get(vae.get("_class_name"))
    return None if channels is None else VAE_DECODE_FACTOR * b * height * width * channels(vae)


def _plan_image(cfg, gpus: int, gpu_memory_gib: float) -> Plan:
    m, s, t = cfg.model, cfg.sample, cfg.train
    fam = _family_of(m.path, m.family)
    local, minibatch, micro = _batch_shape(cfg, gpus)
    dtype, b = m.dtype, DTYPE_BYTES[m.dtype]
    skip = fam.t5_components if m.drop_t5 else ()
    pipeline_class, parts, source = pipeline_components(m.path, dtype, skip=skip)
    components = {c.name: c for c in parts}
    if fam.denoiser_attr not in components:
        raise PlanError(f"{m.path}: its pipeline has no {fam.denoiser_attr} ({fam.denoiser_class}) to train")
    den = components[fam.denoiser_attr]
    rewards, notes = reward_components(cfg.rewards)
    features, feature_notes = feature_components(cfg.eval.diversity_features)
    rewards, notes = rewards + features, notes + feature_notes  # placed as rewards are: off the GPU with offload
    layout = LAYOUTS.get(den.class_name, GENERIC_LAYOUT)

    targets = list(cfg.lora.target_modules or fam.lora_targets)
    if cfg.lora.enabled:  # the adapters go into a copy: the built modules are shared
        den_module, adapted = inject_lora(copy.deepcopy(den.module), cfg.lora.rank, cfg.lora.alpha, targets)
        n_trained = lora_parameters(den_module)
    else:
        den_module, adapted, n_trained = den.module, {}, den.params
    from .objectives import get_objective

    cfg_rows = 2 if (fam.uses_cfg_encodings and s.guidance_scale > 1) else 1  # the rollout's rows per image
    obj = get_objective(t.objective).memory_terms(cfg, cfg_rows)
    if obj.unit == "pairs":  # a micro-batch counts pairs, the winners: at most the groups of a GPU's batch
        minibatch = min(minibatch, local // s.group_size)
        micro = min(micro, minibatch)
    tr = _Training(n_trained, f"LoRA r{cfg.lora.rank} on {len(adapted)} layers" if cfg.lora.enabled else None,
                   "float32" if cfg.lora.enabled else dtype, t.ema_decay > 0,
                   (0.0 if cfg.lora.enabled else den.weight_bytes) if obj.reference else None,
                   2 * _block_params(den.module, layout.blocks) * b, t.optimizer)

    # what the rollout leaves on the GPU for the update: the trajectory and the prompt encodings
    try:
        frames = fam.check_num_frames(s.num_frames)
    except ValueError as e:
        raise PlanError(str(e)) from None
    files = [_prompt_file(f, cfg.data.image_column)
             for f in {cfg.data.train_prompts, cfg.data.eval_prompts or cfg.data.train_prompts}]
    counted, most = [n for n, _ in files], [k for _, k in files] if fam.condition_images[1] else []
    shape = image_shape(components, fam.denoiser_attr, s.height, s.width, s.max_sequence_length, frames, fam,
                        max(most) if most and None not in most else None)
    kept = obj.latents_kept  # GRPO keeps every step's latents, the forward-process objectives the final ones
    trajectory = local * (kept * shape.latent_elements + shape.condition_elements) * b
    trajectory += local * obj.means_kept * shape.latent_elements * 4  # the transition means (float32), if kept
    n_prompts = min(1024, sum(counted)) if None not in counted else 1024  # ImageBackend's prompt_cache_size
    prompt_cache = n_prompts * shape.text_tokens * shape.text_width * b

    # one micro-batch sample: K trained steps stacked along the batch, doubled by CFG
    layers = denoiser_layers(den_module, den.class_name, image_tokens=shape.image_tokens,
                             text_tokens=shape.text_tokens, levels=shape.levels, lora_targets=adapted)
    terms = activation_terms(layers, dtype)
    update = UpdateEstimate(den.class_name, dtype, obj.rows, terms,
                            activation_bytes(terms, den.class_name, dtype), n_trained * DTYPE_BYTES[tr.dtype], 0.0)

    # the rollout, without gradients: `chunk` images through the denoiser (their CFG rows), then the VAE decoder
    chunk = s.rollout_batch_size or local
    if obj.whole_groups:  # whole groups per call, as ImagePolicy.rollout makes them
        chunk = max(s.group_size, chunk - chunk % s.group_size)
    phases = {"denoiser": (cfg_rows * calibration(den.class_name).gamma * b * terms.units_checkpointed, False)}
    if "vae" in components:
        decode = vae_decode_bytes(_config_dict(components["vae"].module), s.height, s.width, b)
        if decode is None:
            notes.append(f"the VAE decode ({components['vae'].class_name}) of the rollout is not estimated")
        else:
            phases["VAE decode"] = (decode, True)
    rollout = RolloutEstimate(min(chunk, local), phases)

    everywhere = lambda v: {k: v for k in STRATEGIES}  # noqa: E731
    rows = [Row(f"{fam.denoiser_attr} ({den.class_name})", den.params / 1e9,
                {"DDP": den.weight_bytes, "FSDP": den.weight_bytes / gpus, "offload": den.weight_bytes})]
    off_gpu = [c for c in parts if c.name != fam.denoiser_attr] + rewards
    rows += [Row(f"{c.name} ({c.class_name})", c.params / 1e9, {"DDP": c.weight_bytes, "FSDP": c.weight_bytes,
                                                                "offload": None}, "" if c.dtype == dtype else c.dtype)
             for c in off_gpu]
    rows += _training_rows(tr, gpus)
    for name in obj.shadows:  # NFT's old policy, AWM's EMA policy: a second adapter, or a frozen copy
        if cfg.lora.enabled:
            rows.append(Row(f"{t.objective}: shadow adapter '{name}' (float32)", None,
                            {"DDP": 4 * n_trained, "FSDP": 4 * n_trained / gpus, "offload": 4 * n_trained}))
        else:
            rows.append(Row(f"{t.objective}: shadow policy '{name}', a frozen copy", None,
                            {"DDP": den.weight_bytes, "FSDP": den.weight_bytes / gpus, "offload": den.weight_bytes}))
    rows.append(Row(f"trajectory latents ({local} samples x {kept}"
                    + (", with their conditions" if shape.condition_elements else "") + ")", None,
                    everywhere(trajectory)))
    rows.append(Row(f"prompt-encoding cache ({n_prompts} prompts)", None, everywhere(prompt_cache)))

    rows_note = obj.rows_note
    lora = (f"LoRA r{cfg.lora.rank} alpha {cfg.lora.alpha:g} on {', '.join(targets)}" if cfg.lora.enabled
            else f"full fine-tuning of the {fam.denoiser_attr} (weights, gradients, AdamW in {dtype})")
    size = f"{s.height}x{s.width} px" if not fam.video else f"{frames} frames of {s.height}x{s.width} px"
    if shape.sources:
        size += (f" and {shape.sources} conditioning image{'s' if shape.sources > 1 else ''}"
                 + ("" if fam.condition_images[0] == fam.condition_images[1] else
                    " (the most the family takes)" if not most or None in most else " (the most a prompt has)"))
    facts = [
        ("model", f"{m.path} ({fam.family}, {pipeline_class}; configuration: {source})"),
        ("update", f"{lora}; {dtype}; {size} = {shape.image_tokens} image + {shape.text_tokens} "
                   f"text tokens; {rows_note}; {obj.reference_note}"),
        ("batch", f"{local} samples per GPU per epoch, minibatch {minibatch}"
                  + (" pairs (a group's best and worst)" if obj.unit == "pairs" else "") + f", micro-batch {micro}, "
                  f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}"),
        ("GPUs", f"{gpus} x {gpu_memory_gib:g} GiB"),
    ]
    notes.append(f"activations of {den.class_name}: {calibration(den.class_name).measured}")
    host = sum(c.weight_bytes for c in off_gpu) + tr.host_bytes()
    return _finish(facts, rows, update, rollout, tr, micro, minibatch, local, cfg, gpus, gpu_memory_gib, host, notes,
                   rows_note, obj.unit)


#: the decoder layers of a causal LM, which transformers' gradient checkpointing recomputes one at a time
LM_BLOCKS = r"(?:.*\.)?(?:layers|h|blocks)\.\d+"


def lm_layers(module: torch.nn.Module, tokens: int, lora_targets: Mapping[str, int]) -> tuple[list[Layer], int]:
    """(the Linear / Conv1D layers of a causal LM but its output head, all seeing `tokens` tokens; the vocabulary
    size of the head)."""
    from transformers.pytorch_utils import Conv1D

    head = module.get_output_embeddings()
    vocab = head.out_features if head is not None else 0
    layers = []
    for name, mod in module.named_modules():
        if ".lora_" in name or mod is head:
            continue
        name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
        if isinstance(mod, torch.nn.Linear):
            fan_in, fan_out = mod.in_features, mod.out_features
        elif isinstance(mod, Conv1D):  # GPT-2's transposed linear: weight [fan_in, fan_out]
            fan_in, fan_out = mod.weight.shape
        else:
            continue
        block = re.match(rf"({LM_BLOCKS})(\.|$)", name)
        layers.append(Layer(name, "tok", tokens, tokens, fan_in, fan_out, block.group(1) if block else None,
                            lora_targets.get(name, 0)))
    return layers, vocab


def _plan_text(cfg, gpus: int, gpu_memory_gib: float) -> Plan:
    m, t, x = cfg.model, cfg.train, cfg.text
    local, minibatch, micro = _batch_shape(cfg, gpus)
    dtype, b = m.dtype, DTYPE_BYTES[m.dtype]
    model, source = causal_lm(m.path, dtype)
    if cfg.lora.enabled:  # the adapters go into a copy: the built module is shared
        module, adapted = inject_lora(copy.deepcopy(model.module), cfg.lora.rank, cfg.lora.alpha,
                                      cfg.lora.target_modules, causal_lm=True)
        n_trained = lora_parameters(module)
    else:
        module, adapted, n_trained = model.module, {}, model.params
    from .objectives import get_objective

    obj = get_objective(t.objective).memory_terms(cfg, 1)
    tr = _Training(n_trained, f"LoRA r{cfg.lora.rank} on {len(adapted)} layers" if cfg.lora.enabled else None,
                   "float32" if cfg.lora.enabled else dtype, t.ema_decay > 0,
                   (0.0 if cfg.lora.enabled else model.weight_bytes) if obj.reference else None,
                   2 * _block_params(model.module, LM_BLOCKS) * b, t.optimizer)
    tokens = x.max_prompt_length + x.max_new_tokens  # prompts are left-padded to the batch's longest
    layers, vocab = lm_layers(module, tokens, adapted)
    terms = activation_terms(layers, dtype)
    update = UpdateEstimate("causal LM", dtype, 1, terms,
                            activation_bytes(terms, "causal LM", dtype, head_units=tokens * vocab),
                            n_trained * DTYPE_BYTES[tr.dtype], 0.0, tokens * vocab, vocab, x.max_new_tokens)
    rows = [Row(f"model ({model.class_name})", model.params / 1e9,
                {"DDP": model.weight_bytes, "FSDP": model.weight_bytes / gpus, "offload": model.weight_bytes})]
    rows += _training_rows(tr, gpus)
    rows_note = f"{tokens} tokens (max_prompt_length + max_new_tokens), vocabulary {vocab}"
    targets = ", ".join(cfg.lora.target_modules) if cfg.lora.target_modules else "peft's default for the model"
    lora = (f"LoRA r{cfg.lora.rank} alpha {cfg.lora.alpha:g} on {targets}" if cfg.lora.enabled
            else f"full fine-tuning (weights, gradients, AdamW in {dtype})")
    facts = [
        ("model", f"{m.path} ({model.class_name}; configuration: {source})"),
        ("update", f"{lora}; {dtype}; {rows_note}; {obj.reference_note}"),
        ("batch", f"{local} completions per GPU per epoch, minibatch {minibatch}, micro-batch {micro}, "
                  f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}"),
        ("GPUs", f"{gpus} x {gpu_memory_gib:g} GiB"),
    ]
    notes = [f"activations of the causal LM: {calibration('causal LM').measured}"]
    # the rollout: generate() with its KV cache, then the old log-probs of the whole per-GPU batch in one forward
    config = model.module.config.get_text_config()
    heads = getattr(config, "num_attention_heads", 1)
    kv = 2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads)  # keys and values
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    logits = calibration("causal LM").gamma * b * tokens * vocab
    gamma_chunk = calibration("causal LM").gamma_chunk
    rollout = RolloutEstimate(local, {"generate (KV cache)": (kv * head_dim * tokens * b, False),
                                      LOGITS_PHASE: (logits, False)}, lambda n: gamma_chunk * 4 * update.chunk_units(n))
    host = tr.host_bytes()
    return _finish(facts, rows, update, rollout, tr, micro, minibatch, local, cfg, gpus, gpu_memory_gib, host, notes,
                   rows_note)


# ------------------------------------------------------------------------------------ the command line


def parse_memory(text: str) -> float:
    """GiB from "80GiB", "80 GiB", "80G", "80" (GiB), "85.9GB" (10^9 bytes), "81920MiB"."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    units = {"": 1.0, "g": 1.0, "gib": 1.0, "gb": 1e9 / GIB, "m": 1 / 1024, "mib": 1 / 1024, "mb": 1e6 / GIB,
             "t": 1024.0, "tib": 1024.0, "tb": 1e12 / GIB}
    if not m or m.group(2).lower() not in units or float(m.group(1)) <= 0:
        raise PlanError(f"--gpu-memory {text!r}: give a size such as 80GiB, 80GB, 24 or 40960MiB")
    return float(m.group(1)) * units[m.group(2).lower()]


def main(config: str | None, overrides: list[str] | None = None, *, gpus: int = 1, gpu_memory: str = "80GiB") -> int:
    """`flowrl plan CONFIG [key=value ...] [--gpus N] [--gpu-memory 80GiB]`: print the plan; 0 if the config as it
    is (its update and its rollout) fits under one of the strategies, 1 if it fits under none."""
    from .config import load_config

    cfg = load_config(config, overrides or [])
    result = plan(cfg, gpus=gpus, gpu_memory_gib=parse_memory(gpu_memory))
    print(result.render())
    return 0 if any(result.fits_as_configured(s) for s in STRATEGIES) else 1
