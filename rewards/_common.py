"""Helpers shared by the reward files: lazy optional imports, device/dtype, hub-or-local files,
image checks, CLIP embeddings, and the text of a (possibly chat-format) completion."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch
    from PIL import Image


def require(module: str, *, extra: str, package: str, purpose: str) -> ModuleType:
    """Import ``module`` or fail with an error naming the pip package and the flowrl extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{purpose} needs the Python package {package!r} (module {module!r}), which is not installed: "
            f"pip install 'flowrl[{extra}]'  (or: pip install {package})"
        ) from e


_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def resolve_device(device: "str | torch.device | None") -> "torch.device":
    """``None`` -> the first CUDA device if there is one, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: "str | torch.dtype") -> "torch.dtype":
    """A torch dtype from a dtype or one of the names float32/fp32, float16/fp16/half, bfloat16/bf16."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPES)} or a torch.dtype")
    return getattr(torch, _DTYPES[dtype])


def resolve_file(spec: str | os.PathLike, filename: str) -> str:
    """A local path for a weights file given as a file path, a directory holding ``filename``,
    or a hub repository id holding ``filename`` (downloaded into the HF cache; HF_HUB_OFFLINE is
    respected)."""
    spec = os.fspath(spec)
    if os.path.isfile(spec):
        return spec
    if os.path.isdir(spec):
        path = os.path.join(spec, filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"directory {spec!r} has no file {filename!r}; give the file's path instead")
        return path
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id=spec, filename=filename)
    except Exception as e:  # offline, unknown repo, no network: say what was tried
        raise FileNotFoundError(
            f"{spec!r} is neither a local file nor a directory, and {filename!r} could not be fetched from "
            f"the hub repository {spec!r} ({type(e).__name__}: {e}). Give a local path to the weights."
        ) from e


def load_state_dict(path: str) -> dict[str, Any]:
    """A state dict from ``.safetensors`` or from a torch file read with ``weights_only=True``.
    A checkpoint of the form ``{"state_dict": {...}}`` is unwrapped, and DDP's ``module.`` prefix dropped."""
    import torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} holds a {type(state).__name__}, not a state dict")
    return {k.removeprefix("module."): v for k, v in state.items()}


def check_images(images: Sequence["Image.Image"], prompts: Sequence[str], who: str) -> list["Image.Image"]:
    """The images as RGB PIL images, after checking there is one prompt per image."""
    from PIL import Image

    images = list(images)
    bad = [type(x).__name__ for x in images if not isinstance(x, Image.Image)]
    if bad:
        raise TypeError(f"{who} takes a list of PIL images, got items of type {sorted(set(bad))}")
    if len(images) != len(prompts):
        raise ValueError(f"{who}: {len(images)} images but {len(prompts)} prompts; give one prompt per image")
    return [x if x.mode == "RGB" else x.convert("RGB") for x in images]


def pooled(output: Any) -> "torch.Tensor":
    """The projected embedding from ``CLIPModel.get_*_features`` (a tensor in transformers 4,
    an output whose ``pooler_output`` is projected in transformers 5)."""
    import torch

    return output if isinstance(output, torch.Tensor) else output.pooler_output


def clip_embeddings(model: Any, processor: Any, images: list["Image.Image"], prompts: Sequence[str],
                    device: "torch.device", dtype: "torch.dtype") -> tuple["torch.Tensor", "torch.Tensor"]:
    """L2-normalised CLIP image and text embeddings, ``[B, D]`` each, float32, from one forward of
    each tower. Text is padded and truncated to the model's 77 positions."""
    import torch

    max_len = model.config.text_config.max_position_embeddings
    pixels = processor(images=images, return_tensors="pt")["pixel_values"].to(device, dtype)
    text = processor(text=list(prompts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    with torch.no_grad():
        img = pooled(model.get_image_features(pixel_values=pixels)).float()  # [B, D]
        txt = pooled(model.get_text_features(input_ids=text["input_ids"].to(device),
                                             attention_mask=text["attention_mask"].to(device))).float()  # [B, D]
    return img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)


def load_clip(model: str, processor: str | None, device: "torch.device", dtype: "torch.dtype") -> tuple[Any, Any]:
    """A ``CLIPModel`` (eval mode, on ``device`` in ``dtype``) and its ``CLIPProcessor``, each from a hub
    id or a local directory; the processor comes from ``model`` unless given."""
    from transformers import CLIPModel, CLIPProcessor

    clip = CLIPModel.from_pretrained(model).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return clip, CLIPProcessor.from_pretrained(processor or model)


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string, or chat messages ``[{"role", "content"}, ...]`` whose
    assistant contents are joined (content may itself be a list of ``{"type": "text", "text"}`` parts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for message in completion:
        if not isinstance(message, dict) or "content" not in message:
            raise TypeError(f"a chat completion is a list of {{'role', 'content'}} dicts, got item {message!r}")
        if message.get("role", "assistant") != "assistant":
            continue
        content = message["content"]
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(content or "")
    return "".join(parts)
