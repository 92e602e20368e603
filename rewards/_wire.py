"""The JSON wire format between ``rewards.remote`` and ``rewards.server``.

POST /score, image kind:  {"images": [base64 PNG, ...], "prompts": [...], "metadata": {...}}
                     ->   {"scores": [float, ...], "components": {name: [float, ...]}}
POST /score, text kind:   {"prompts": [...], "completions": [...], "columns": {...}}
                     ->   {"scores": [float | null, ...]}
GET /health          ->   {"status": "ok", "reward": NAME, "kind": "image" | "text"}
Errors               ->   {"error": message} with status 400 (bad request), 413 (a body over the server's limit,
                          64 MiB unless started with --max-request-mb), 500 (reward failed).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from PIL import Image


def encode_png(image: Image.Image) -> str:
    """Lossless base64 PNG of a PIL image."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: str) -> Image.Image:
    """The PIL image (RGB) of a base64 PNG; ValueError on anything else."""
    try:
        raw = base64.b64decode(data, validate=True)
        image = Image.open(io.BytesIO(raw))
        if image.format != "PNG":
            raise ValueError(f"expected a PNG, got {image.format}")
        image.load()
    except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a base64 PNG image: {e}") from e
    return image.convert("RGB")


def to_jsonable(value: Any, where: str = "value") -> Any:
    """Tensors and numpy arrays/scalars to lists/numbers, recursively; TypeError naming ``where`` else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "tolist"):  # torch.Tensor, numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{where} of type {type(value).__name__} cannot be sent to a reward server as JSON")
