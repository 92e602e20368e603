"""Helpers shared by the reward files: lazy optional imports, device/dtype, hub-or-local files,
image checks, CLIP embeddings, the text of a (possibly chat-format) completion, and calling a text
reward the way TRL's ``GRPOTrainer`` does (``call_text_reward``)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rewards.memory import DTYPE_NAMES

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
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_NAMES)} or a torch.dtype")
    return getattr(torch, DTYPE_NAMES[dtype])


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

    from flowrl import hub

    hub.settle()  # (offline at once when the hub cannot be reached)
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


def clip_embeddings(
    model: Any,
    processor: Any,
    images: list["Image.Image"],
    prompts: Sequence[str],
    device: "torch.device",
    dtype: "torch.dtype",
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """L2-normalised CLIP image and text embeddings, ``[B, D]`` each, float32, from one forward of
    each tower. Text is padded and truncated to the model's 77 positions."""
    import torch

    max_len = model.config.text_config.max_position_embeddings
    pixels = processor(images=images, return_tensors="pt")["pixel_values"].to(device, dtype)
    text = processor(text=list(prompts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    with torch.no_grad():
        img = pooled(model.get_image_features(pixel_values=pixels)).float()  # [B, D]
        txt = pooled(
            model.get_text_features(
                input_ids=text["input_ids"].to(device), attention_mask=text["attention_mask"].to(device)
            )
        ).float()  # [B, D]
    return img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)


def load_clip(model: str, processor: str | None, device: "torch.device", dtype: "torch.dtype") -> tuple[Any, Any]:
    """A ``CLIPModel`` (eval mode, on ``device`` in ``dtype``) and its ``CLIPProcessor``, each from a hub
    id or a local directory; the processor comes from ``model`` unless given."""
    from transformers import CLIPModel, CLIPProcessor

    from flowrl import hub

    hub.settle_for(model, processor or model)  # (offline at once when the hub cannot be reached)
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


# ---------------------------------------------------------------------------- calling rewards like TRL

TRL_EXTRAS = ("trainer_state", "log_metric", "log_extra")
"""Keyword arguments TRL passes to every reward besides the batch and the dataset columns."""


@dataclass
class RewardState:
    """What a TRL reward function reads from ``trainer_state``: the optimizer steps taken so far, the
    training epoch (TRL's ``TrainerState.epoch``) and the planned number of steps (0 = unknown).
    The trainer updates one instance in place; rewards use it to schedule their shaping."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


def accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The items of ``kwargs`` that ``fn`` accepts by keyword: all of them when it takes ``**kwargs`` or
    its signature cannot be read (a builtin), else only the names among its parameters."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {k: v for k, v in kwargs.items() if k in params and params[k].kind in by_keyword}


_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_pid = -1
_loop_lock = threading.Lock()


def _reward_loop() -> asyncio.AbstractEventLoop:
    """The event loop that runs async rewards: one per process, in a daemon thread, kept across calls
    (an async client such as an HTTP session made on the first call stays usable, as in TRL)."""
    global _loop, _loop_thread, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid() or not _loop_thread.is_alive():  # a forked child has no thread
            _loop = asyncio.new_event_loop()
            _loop_thread = threading.Thread(target=_loop.run_forever, name="flowrl-reward-loop", daemon=True)
            _loop_thread.start()
            _loop_pid = os.getpid()
        return _loop


def resolve_awaitable(value: Any) -> Any:
    """``value`` itself, or its result when it is awaitable (an async reward's coroutine), awaited on the
    reward loop's thread: this works whether or not the calling thread already runs an event loop."""
    if not inspect.isawaitable(value):
        return value
    loop = _reward_loop()
    if threading.current_thread() is _loop_thread:
        raise RuntimeError("an async reward cannot wait for another async reward synchronously; await it instead")

    async def wait() -> Any:
        return await value

    return asyncio.run_coroutine_threadsafe(wait(), loop).result()


def text_scores(values: Any, n: int, who: str) -> list[float | None]:
    """A text reward's output as ``n`` scores, each a float or None (the reward does not apply there).
    Lists, tuples, arrays and tensors are read; anything else, another length or a score that is not a
    number is a ValueError naming ``who``. NaN and infinities pass through: the trainer decides."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise ValueError(
            f"reward {who!r} returned a {type(values).__name__}; a text reward returns one score "
            f"(a number or None) per completion"
        )
    values = list(values)
    if len(values) != n:
        raise ValueError(f"reward {who!r} returned {len(values)} scores for {n} completions")
    scores: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            scores.append(None)
            continue
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            scores.append(float(value))
        except (TypeError, ValueError):
            raise ValueError(
                f"reward {who!r} returned {value!r} ({type(value).__name__}) for completion {i}; "
                f"scores are numbers or None"
            ) from None
    return scores


def call_text_reward(
    fn: Callable[..., Any],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None,
    columns: dict[str, Sequence[Any]],
    *,
    state: RewardState,
    logs: dict[str, list[float]],
    extra: dict[str, list[Any]] | None = None,
) -> list[float | None]:
    """Call a text reward as TRL's ``GRPOTrainer`` does, and return its scores (float or None each).

    The reward gets, by keyword, ``prompts``, ``completions``, ``completion_ids``, each dataset column
    (one value per completion), ``trainer_state`` (``state``), ``log_metric(name, value)`` and
    ``log_extra(column, values)`` -- only those its signature names, all of them when it takes
    ``**kwargs``. An async reward (or one returning an awaitable) is awaited. ``log_metric`` appends
    ``float(value)`` to ``logs[name]``; ``log_extra`` extends ``extra[column]`` (dropped when ``extra``
    is None).
    """

    def log_metric(name: str, value: float) -> None:
        logs.setdefault(str(name), []).append(float(value))

    def log_extra(column: str, values: Sequence[Any]) -> None:
        if extra is not None:
            extra.setdefault(str(column), []).extend(values)

    kwargs = {
        **columns,
        "prompts": list(prompts),
        "completions": list(completions),
        "completion_ids": None if completion_ids is None else [list(ids) for ids in completion_ids],
        "trainer_state": state,
        "log_metric": log_metric,
        "log_extra": log_extra,
    }
    out = resolve_awaitable(invoke_text_reward(fn, kwargs))
    return text_scores(out, len(completions), getattr(fn, "__name__", repr(fn)))


def takes_batch_by_position(fn: Callable[..., Any]) -> bool:
    """True for a text reward with no ``completions`` keyword but two positional parameters, such as
    ``(prompts_or_images, *args, **kwargs)``: it is called as ``fn(prompts, completions, **rest)``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.name == "completions" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def invoke_text_reward(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``fn`` called with the batch and columns in ``kwargs`` (``prompts``, ``completions``, ...): by
    keyword as TRL does, or with the two first positionally when it names them otherwise
    (``takes_batch_by_position``); the other keywords only as far as ``fn`` accepts them."""
    if takes_batch_by_position(fn):
        rest = {k: v for k, v in kwargs.items() if k not in ("prompts", "completions")}
        return fn(kwargs.get("prompts"), kwargs.get("completions"), **accepted_kwargs(fn, rest))
    return fn(**accepted_kwargs(fn, kwargs))


def image_scores(values: Any, n: int, who: str) -> "torch.Tensor":
    """An image reward's output (tensor, numpy array, list or tuple of numbers) as a float32 ``[n]``
    tensor; anything else, or another count, is a ValueError naming ``who``. NaN and infinities pass."""
    import torch

    try:
        if isinstance(values, (str, bytes, dict)):
            raise TypeError(f"a {type(values).__name__}")
        wide = isinstance(values, (list, tuple))  # Python numbers: read as float64, then checked for float32
        text = next((v for v in values if isinstance(v, (str, bytes))), None) if wide else None
        if text is not None:
            raise TypeError(f"{text!r} is text: convert each score with float()")
        given = torch.as_tensor(values, dtype=torch.float64 if wide else None).detach()
        if given.is_complex():
            raise TypeError("complex numbers")
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"reward {who!r} returned {type(values).__name__} that is not numbers ({e}); an image "
            f"reward returns one number per image (a list, tuple, numpy array or tensor)"
        ) from None
    if given.dtype in (torch.float64, torch.int64):
        huge = torch.isfinite(given) & (given.abs() > torch.finfo(torch.float32).max)
        if bool(huge.any()):  # as float32 it would be an infinity, which the trainer reads as "no score"
            raise ValueError(
                f"reward {who!r} returned the score {given[huge][0].item():g}, beyond float32's range (the scores "
                f"are float32, where it would be an infinity, read as no score); scale the scores down"
            )
    given = given.to(torch.float32)
    scores = given.reshape(-1)  # [n]
    kept = [d for d in given.shape if d != 1]  # a column [n, 1] or a row [1, n] is one score per image
    if scores.numel() != n or len(kept) > 1:
        shape = f" (shape {list(given.shape)})" if given.ndim > 1 else ""
        raise ValueError(
            f"reward {who!r} returned {scores.numel()} scores{shape} for {n} images; an image reward returns one "
            f"number per image ([{n}], or a column [{n}, 1])"
        )
    return scores
