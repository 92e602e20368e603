"""Tiny random-weight diffusers backends for the rollout tests (offline, one CPU thread).

Backends are cached per family: building one is cheap, but the tests only read them. A test that
changes its backend (a LoRA adapter, a scheduler swap) takes a `fresh_backend` instead.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flowrl.families import load_image_backend  # noqa: E402

torch.set_num_threads(1)

FAMILIES = ("sd3", "flux", "sd15")
STOCHASTIC_SDE_TYPES = {"sd3": ("sde", "cps", "dance"), "flux": ("sde", "cps", "dance"), "sd15": ("ddim",)}
PROMPTS = ["a red cat", "a blue dog"]
#: a tiny image run on the CPU (tiny-sd3, 32 px, 3 steps, 2 prompts x 4): end-to-end tests add their own overrides
TINY_RUN = [
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=3",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=4",
    "log.progress=false",
    "model.device=cpu",
]
SIZE = 32

_backends = {}


def tiny_backend(family: str):
    if family not in _backends:
        _backends[family] = fresh_backend(family)
    return _backends[family]


def fresh_backend(family: str, **kwargs):
    return load_image_backend(f"tiny-{family}", **kwargs)


def tiny_rollout(backend, *, group_size=2, num_steps=4, seed=0, **kwargs):
    kwargs.setdefault("decode", False)
    return backend.rollout(PROMPTS, group_size, num_steps=num_steps, seed=seed, height=SIZE, width=SIZE, **kwargs)


def max_abs_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()
