"""HPS v2 / v2.1 (Wu et al. 2023, "Human Preference Score v2"): an open_clip ViT-H-14 fine-tuned on
human preferences; the score is the cosine of the L2-normalised image and text features. The
preprocessing is the original's evaluation transform: resize the longest side to the model's input
size (bicubic), pad to a square with black (centred), OpenAI CLIP mean/std."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from PIL import Image

from rewards._common import check_images, load_state_dict, resolve_device, resolve_dtype, resolve_file
from rewards.memory import Held, HubModel, NotEstimated, dtype_name
from rewards.registry import IMAGE, register

CHECKPOINTS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resize_longest_and_pad(image: Image.Image, size: int, fill: int = 0) -> Image.Image:
    """Scale so that the longest side is ``size`` (bicubic, sides rounded), then pad the short side
    with ``fill`` to a ``size × size`` square, the extra pixel (odd padding) going right/bottom."""
    width, height = image.size
    scale = size / max(width, height)
    new_w, new_h = round(width * scale), round(height * scale)
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    canvas = Image.new(image.mode, (size, size), (fill,) * len(image.getbands()))
    canvas.paste(image, ((size - new_w) // 2, (size - new_h) // 2))
    return canvas


def hps_pixels(images: list[Image.Image], size: int) -> torch.Tensor:
    """``[B, 3, size, size]`` float32 pixels, normalised with the OpenAI CLIP mean/std."""
    arrays = [np.asarray(resize_longest_and_pad(x, size), dtype=np.float32) / 255.0 for x in images]
    pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # [B, 3, H, W]
    mean, std = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1), torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    return (pixels - mean) / std


#: the transformers configuration of open_clip's ViT-H-14 (the architecture HPS v2 fine-tunes): laion's CLIP-H
VIT_H_14 = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


def clip_h_memory(options: dict) -> list[Held]:
    """The open_clip ViT-H-14 it builds, sized as the same architecture in transformers (``CLIPModel`` of laion's
    CLIP-H), in the ``dtype`` option; another ``architecture`` is not estimated."""
    if options["architecture"] != "ViT-H-14":
        return [NotEstimated(f"open_clip architecture {options['architecture']!r} is not the ViT-H-14 it is sized as")]
    return [HubModel(VIT_H_14, "CLIPModel", dtype_name(options["dtype"]))]


@register("hpsv2", kind=IMAGE, memory=clip_h_memory, summary="HPS v2 / v2.1 (open_clip ViT-H-14)")
class HPSv2:
    """HPS v2(.1) per image: ``<f_img/|f_img|, f_txt/|f_txt|>``.

    Args:
        version: "v2.1" (default) or "v2.0": picks the checkpoint file name in ``checkpoint``.
        checkpoint: the HPS state dict: a file (``.pt`` read with ``weights_only=True``, or ``.safetensors``),
            a directory holding the version's file, or a hub repository holding it.
        architecture: an open_clip model name (the original is "ViT-H-14"), or a local directory with an
            ``open_clip_config.json`` (``{"model_cfg": {...}}``). Its weights come from ``checkpoint`` only.
        device, dtype: as for every reward backbone.
    """

    kind = IMAGE

    def __init__(
        self,
        version: str = "v2.1",
        checkpoint: str = "xswu/HPSv2",
        architecture: str = "ViT-H-14",
        device: str | None = None,
        dtype: str | torch.dtype = "float32",
    ):
        if version not in CHECKPOINTS:
            raise ValueError(f"unknown HPS version {version!r}; valid: {', '.join(CHECKPOINTS)}")
        import open_clip

        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        arch = f"local-dir:{architecture}" if os.path.isdir(architecture) else architecture
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)  # open_clip warns "initialized randomly": the weights come next
        try:
            self.model = open_clip.create_model(
                arch,
                pretrained=None,
                load_weights=False,
                precision=_PRECISION.get(self.dtype, "fp32"),
                device=self.device,
            )
        finally:
            logging.disable(previous)
        path = resolve_file(checkpoint, CHECKPOINTS[version])
        try:
            self.model.load_state_dict(load_state_dict(path))
        except RuntimeError as e:
            raise ValueError(f"HPS checkpoint {path!r} does not fit open_clip {architecture!r}: {e}") from e
        self.model.eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(arch)
        size = self.model.visual.image_size
        self.image_size = size[0] if isinstance(size, (tuple, list)) else size
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, "hpsv2")
        param_dtype = next(self.model.visual.parameters()).dtype
        pixels = hps_pixels(images, self.image_size).to(self.device, param_dtype)  # [B, 3, S, S]
        tokens = self.tokenizer(list(prompts)).to(self.device)  # [B, 77]
        with torch.no_grad():
            image_features = self.model.encode_image(pixels, normalize=True).float()  # [B, D]
            text_features = self.model.encode_text(tokens, normalize=True).float()  # [B, D]
        self.last_components = {}
        return (image_features * text_features).sum(-1).cpu()  # [B]
