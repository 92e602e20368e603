"""Model backends: diffusers image pipelines as policies (`image`), tiny random-weight pipelines (`tiny`).

Importing this package does not import diffusers; loading a backend does.
"""

from flowrl.backends.image import (
    IMAGE_BACKENDS,
    ImageBackend,
    ImageModelError,
    SizeRule,
    StepLogProb,
    detect_family,
    load_image_backend,
    preflight_image_model,
)
from flowrl.backends.image_flow import FluxBackend, SD3Backend
from flowrl.backends.image_sd15 import SD15Backend
from flowrl.backends.tiny import (
    TINY_PIPELINES,
    tiny_config_files,
    tiny_flux_pipeline,
    tiny_sd3_pipeline,
    tiny_sd15_pipeline,
)

__all__ = [
    "IMAGE_BACKENDS",
    "FluxBackend",
    "ImageBackend",
    "ImageModelError",
    "SD15Backend",
    "SD3Backend",
    "SizeRule",
    "StepLogProb",
    "TINY_PIPELINES",
    "detect_family",
    "load_image_backend",
    "preflight_image_model",
    "tiny_config_files",
    "tiny_flux_pipeline",
    "tiny_sd15_pipeline",
    "tiny_sd3_pipeline",
]
