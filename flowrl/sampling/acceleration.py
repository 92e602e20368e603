"""Rollout accelerators (`rollout.acceleration`): each one declared lossless or lossy, with its knobs, what a family
needs to take it (`problem`), and how it is switched on around the rollout's sampling and off again (`accelerated`).

- lossless: the rollout's samples and recorded log-probs stay those of the trained policy (regional torch.compile,
  the attention backend), so a coupled objective (GRPO: its ratio uses the recorded log-probs) may use them;
- lossy: diffusers' step caches reuse computation across denoising steps, which changes the samples' distribution;
  only the decoupled objectives (they train on the final samples alone) may use them. The caches are attached for
  one rollout call and removed after it, so their state starts afresh every call and never reaches the update's
  forward passes or the reference pass.

flowrl samples with its own recorder loop, not `pipe(...)`: diffusers' pipelines name each denoiser call for the
caches (`cache_context("cond")`); here every call of the denoiser is named by its rows and its place within the
step (a family that runs the conditional and unconditional passes as two calls gets two states, as in diffusers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from flowrl.core.registry import Registry

ACCELERATORS: Registry[type[Accelerator]] = Registry("rollout accelerator")

#: attention backends of diffusers' dispatcher that run on a CPU (the others need CUDA kernels or packages)
CPU_ATTENTION_BACKENDS = ("native", "_native_math")


class Accelerator:
    """One accelerator: `Knobs` (a dataclass, a docstring under each field), `problem(backend)` (why a family cannot
    take it, or None), `enable(backend, knobs, num_steps)` and `disable(backend)`."""

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    summary: ClassVar[str] = ""

    @dataclass
    class Knobs:
        pass

    @classmethod
    def problem(cls, backend) -> str | None:
        return cls.unavailable()

    @classmethod
    def unavailable(cls) -> str | None:
        """Why no model can take it on flowrl's rollout loop, whatever the family (refused with the config, before
        any model loads), or None."""
        return None

    @classmethod
    def slower_here(cls, backend, knobs) -> str | None:
        """Why this accelerator would slow this machine's rollout down rather than speed it up (it is then left off,
        with a warning: `usable`), or None."""
        return None

    def enable(self, backend, knobs, num_steps: int) -> None:
        raise NotImplementedError

    def disable(self, backend) -> None:
        raise NotImplementedError


def register(cls: type[Accelerator]) -> type[Accelerator]:
    return ACCELERATORS.register(cls.name)(cls)


def accelerator_names() -> list[str]:
    return ACCELERATORS.names()


def decoupled_objectives() -> list[str]:
    """The image objectives a lossy accelerator may serve: those that roll out and whose loss needs only the final
    samples (not offline DPO, which samples nothing)."""
    from flowrl.objectives import get_objective, objective_names

    def serves(obj) -> bool:
        return not obj.coupled and "image" in obj.backends and obj.scores_batch

    return [n for n in objective_names() if serves(get_objective(n))]


# ------------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class AcceleratorSpec:
    """A parsed entry of rollout.acceleration: the accelerator and its knobs."""

    name: str
    knobs: Any

    @property
    def accelerator(self) -> type[Accelerator]:
        return ACCELERATORS.get(self.name)


def parse_entry(entry: Any, where: str) -> AcceleratorSpec:
    """`compile` or `{name: first_block_cache, threshold: 0.1}` -> AcceleratorSpec; a ValueError of one line naming
    the valid accelerators or knobs."""
    from flowrl.config.values import convert_value
    from flowrl.errors import ConfigError

    if isinstance(entry, str):
        entry = {"name": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ValueError(
            f"{where}: an accelerator is a name or a mapping with a name and its knobs, e.g. compile or "
            f"{{name: first_block_cache, threshold: 0.05}}; got {entry!r}"
        )
    name = entry["name"]
    if name not in ACCELERATORS:
        raise ValueError(f"{where}: {_unknown(name)}")
    cls = ACCELERATORS.get(name)
    hints = typing.get_type_hints(cls.Knobs)
    knobs = {}
    for k, v in entry.items():
        if k == "name":
            continue
        if k not in hints:
            valid = ", ".join(hints) or "none"
            raise ValueError(f"{where}: {name} has no knob {k!r}; its knobs: {valid}")
        try:
            knobs[k] = convert_value(v, hints[k], f"{where}.{k}")
        except ConfigError as e:
            raise ValueError(str(e)) from None
    try:
        return AcceleratorSpec(name, cls.Knobs(**knobs))
    except ValueError as e:
        raise ValueError(f"{where}: {name}: {e}") from None


def _unknown(name: str) -> str:
    from flowrl.core.registry import unknown_name_error

    return str(unknown_name_error("rollout accelerator", name, accelerator_names()))


def parse(entries: list) -> list[AcceleratorSpec]:
    specs = [parse_entry(e, f"rollout.acceleration[{i}]") for i, e in enumerate(entries)]
    names = [s.name for s in specs]
    for n in set(names):
        if names.count(n) > 1:
            raise ValueError(f"rollout.acceleration names {n} twice; give it once")
    caches = [s.name for s in specs if issubclass(s.accelerator, StepCache)]
    if len(caches) > 1:
        raise ValueError(
            f"rollout.acceleration: {' and '.join(caches)} are both step caches, and a denoiser takes one at a "
            "time; keep one"
        )
    return specs


def config_problems(cfg) -> list[str]:
    """What rollout.acceleration cannot be in `cfg`, one line each (checked before any model loads)."""
    entries = cfg.rollout.acceleration
    if not entries:
        return []
    if cfg.backend != "image":
        return [
            f"rollout.acceleration accelerates image rollouts, and backend={cfg.backend}; set rollout.acceleration=[]"
        ]
    try:
        specs = parse(entries)
    except ValueError as e:
        return [str(e)]
    from flowrl.objectives import get_objective

    objective = cfg.train.objective
    problems = []
    for s in specs:
        why = s.accelerator.unavailable()
        if why is not None:
            problems.append(f"rollout.acceleration: {s.name} is not available on flowrl's rollout loop: {why}")
    if get_objective(objective).coupled:
        for s in specs:
            if not s.accelerator.lossless and s.accelerator.unavailable() is None:
                problems.append(
                    f"rollout.acceleration: {s.name} is lossy (it changes the samples' distribution), and "
                    f"train.objective={objective} trains on the rollout's recorded log-probs; use {s.name} with "
                    f"train.objective={' or '.join(decoupled_objectives())}, or a lossless accelerator "
                    f"({', '.join(n for n in accelerator_names() if ACCELERATORS.get(n).lossless)})"
                )
    return problems


# ------------------------------------------------------------------------------------------- using them


def check_supported(backend, specs: list[AcceleratorSpec]) -> None:
    """A ConfigError (a ValueError; the command line's one line) for the first accelerator the loaded model cannot
    take (`Accelerator.problem`: what depends on the model is known once it is loaded)."""
    from flowrl.errors import ConfigError

    for s in specs:
        why = s.accelerator.problem(backend)
        if why is not None:
            raise ConfigError(f"rollout.acceleration: {s.name} is not available for family {backend.family}: {why}")


def usable(backend, specs: list[AcceleratorSpec]) -> list[AcceleratorSpec]:
    """`specs` without the accelerators that would slow this machine's rollout down (`Accelerator.slower_here`),
    each left off with a warning of one line that says why and how to keep it."""
    import warnings

    kept = []
    for s in specs:
        why = s.accelerator.slower_here(backend, s.knobs)
        if why is None:
            kept.append(s)
        else:
            warnings.warn(f"rollout.acceleration: {s.name} is left off: {why}", AcceleratorWarning, stacklevel=2)
    return kept


class AcceleratorWarning(UserWarning):
    """An accelerator of rollout.acceleration left off on this machine (it would be slower than without it)."""


@contextlib.contextmanager
def accelerated(backend, specs: list[AcceleratorSpec], num_steps: int):
    """Every accelerator of `specs` on the backend's denoiser for the body (the rollout's sampling), off after it."""
    if not specs:
        yield
        return
    check_supported(backend, specs)
    done: list[Accelerator] = []
    try:
        for s in specs:
            acc = _instance(s.accelerator)
            acc.enable(backend, s.knobs, num_steps)
            done.append(acc)
        yield
    finally:
        for acc in reversed(done):
            acc.disable(backend)


_INSTANCES: dict[type, Accelerator] = {}


def _instance(cls: type[Accelerator]) -> Accelerator:
    """One instance per accelerator class (compile keeps its compiled blocks between rollouts)."""
    return _INSTANCES.setdefault(cls, cls())


def _diffusers_model(backend) -> torch.nn.Module:
    den = backend.denoiser
    return getattr(den, "module", den)  # a wrapped (DDP) module's own model


# ------------------------------------------------------------------------------------------- lossless


@register
class Compile(Accelerator):
    name = "compile"
    lossless = True
    summary = "regional torch.compile of the denoiser's repeated blocks, each block compiled once"

    @dataclass
    class Knobs:
        mode: str = "default"
        """torch.compile's mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs."""
        fullgraph: bool = False
        """Compile each block as one graph (an error instead of a graph break)."""
        dynamic: bool = False
        """Compile for dynamic shapes (fewer recompiles when the batch changes, slower kernels)."""
        update: bool = False
        """Keep the blocks compiled outside the rollout too (the update's forward and backward, the reference pass,
        the eval): faster updates, and the rollout's and the update's kernels are then both the compiler's. Off: the
        update runs eager (in float32 its first ratio is 1 to ~1e-6; in bfloat16 compiled and eager kernels round
        differently, see docs/benchmarks.md)."""

        def __post_init__(self):
            modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
            if self.mode not in modes:
                raise ValueError(f"mode {self.mode!r} is not one of {', '.join(modes)}")

    @classmethod
    def problem(cls, backend):
        if not repeated_blocks(backend):
            den = _diffusers_model(backend)
            return (
                f"{type(den).__name__} declares no repeated blocks (diffusers' `_repeated_blocks`, or the family's "
                "`repeated_blocks`), so regional compilation has nothing to compile"
            )
        return None

    def __init__(self):
        self._compiled: dict[tuple, Any] = {}  # (id(block), knobs) -> its compiled call, kept between rollouts
        self._keep = False

    def enable(self, backend, knobs, num_steps):
        self._keep = knobs.update
        # each block class is one code object for dynamo: blocks of different structure (SD3.5's dual-attention
        # ones), grad on or off, the adapter on or off each take a variant; dynamo's default limit (8) would send
        # the rest back to eager with a warning
        dyn = torch._dynamo.config
        dyn.recompile_limit = max(dyn.recompile_limit, 64)
        for block in repeated_blocks(backend):
            key = (id(block), knobs.mode, knobs.fullgraph, knobs.dynamic)
            if key not in self._compiled:
                block.compile(mode=knobs.mode, fullgraph=knobs.fullgraph, dynamic=knobs.dynamic)
                self._compiled[key] = block._compiled_call_impl
            block._compiled_call_impl = self._compiled[key]

    def disable(self, backend):
        if self._keep:
            return  # update: true keeps them compiled for the update, the reference pass and the eval
        for block in repeated_blocks(backend):
            block._compiled_call_impl = None  # eager again: the update and the reference pass run uncompiled


def repeated_blocks(backend) -> list[torch.nn.Module]:
    """The blocks regional compilation compiles: those in the ModuleLists the family names (`repeated_blocks` of
    its backend class: SD3 and SANA, which diffusers 0.42 leaves undeclared), else the modules of the classes the
    diffusers model declares (`_repeated_blocks`: FLUX's, Wan's, the UNet's BasicTransformerBlock, ...)."""
    den = _diffusers_model(backend)
    attrs = getattr(backend, "repeated_blocks", ())
    if attrs:
        return [b for a in attrs for b in getattr(den, a, None) or []]
    names = set(getattr(den, "_repeated_blocks", None) or [])
    return [m for m in den.modules() if type(m).__name__ in names]


@register
class AttentionBackend(Accelerator):
    name = "attention_backend"
    lossless = True
    summary = "diffusers' attention dispatcher backend for the rollout (`set_attention_backend`)"

    @dataclass
    class Knobs:
        backend: str = "native"
        """A name of diffusers' AttentionBackendName (`native` = torch's scaled_dot_product_attention; on a CPU
        `native` and `_native_math` run; `flash`, `sage`, `xformers`, `_native_flash`, ... need CUDA and their
        packages)."""

        def __post_init__(self):
            from diffusers.models.attention_dispatch import AttentionBackendName

            valid = sorted(x.value for x in AttentionBackendName)
            if self.backend not in valid:
                raise ValueError(f"backend {self.backend!r} is not one of diffusers' {', '.join(valid)}")

    @classmethod
    def problem(cls, backend):
        den = _diffusers_model(backend)
        if not any(hasattr(getattr(m, "processor", None), "_attention_backend") for m in den.modules()):
            return (
                f"the attention processors of {type(den).__name__} do not go through diffusers' attention "
                "dispatcher, so there is no backend to choose"
            )
        return None

    def enable(self, backend, knobs, num_steps):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        self._active = _AttentionBackendRegistry._active_backend
        with _quiet_diffusers():
            _diffusers_model(backend).set_attention_backend(knobs.backend)

    def disable(self, backend):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        with _quiet_diffusers():
            _diffusers_model(backend).reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(self._active)  # set_attention_backend sets it process-wide


@contextlib.contextmanager
def _quiet_diffusers():
    """diffusers' "experimental feature" warning, once per rollout otherwise."""
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


# ------------------------------------------------------------------------------------------- lossy: precision


@register
class Autocast(Accelerator):
    name = "autocast"
    lossless = False
    summary = "the denoiser's rollout forward in bfloat16 (or float16) under torch.autocast, float32 out"

    @dataclass
    class Knobs:
        dtype: str = "bfloat16"
        """The autocast dtype of the denoiser's matrix products and attention during the rollout: bfloat16 or
        float16. Its output is cast back to float32, so classifier-free guidance, the step math and the recorded
        log-probs stay float32."""

        force: bool = False
        """On a CPU without oneDNN's matrix products in `dtype` (bfloat16: AVX-512 or AMX; float16: AVX512-FP16 or
        AMX-FP16) torch emulates them, several times slower than float32 (0.18x the images per second on an
        AVX2-only CPU, the shapes demo's rollout at 2 threads), so autocast is left off there with a warning and
        the rollout runs in float32; true runs it anyway (e.g. to reproduce a run's bfloat16 samples)."""

        def __post_init__(self):
            if self.dtype not in ("bfloat16", "float16"):
                raise ValueError(f"dtype {self.dtype!r} is not one of bfloat16, float16")

    @classmethod
    def problem(cls, backend):
        if backend.dtype != torch.float32:
            return (
                f"the denoiser already computes in {str(backend.dtype).removeprefix('torch.')} (model.dtype); "
                "autocast lowers a float32 denoiser's rollout"
            )
        if backend.device.type not in ("cpu", "cuda"):
            return f"torch.autocast on {backend.device.type} is not supported here (cpu and cuda are)"
        return None

    @classmethod
    def slower_here(cls, backend, knobs):
        if backend.device.type != "cpu" or knobs.force or native_cpu_dtype(knobs.dtype):
            return None
        need = "AVX-512 or AMX" if knobs.dtype == "bfloat16" else "AVX512-FP16 or AMX-FP16"
        return (
            f"this CPU has no native {knobs.dtype} matrix products ({need}), so torch would emulate them, several "
            f"times slower than float32; the rollout runs in float32 (force it with "
            f"{{name: autocast, force: true}})"
        )

    def enable(self, backend, knobs, num_steps):
        den = _diffusers_model(backend)
        forward, dtype, device = den.forward, getattr(torch, knobs.dtype), backend.device.type

        def autocast_forward(*args, **kwargs):
            with torch.autocast(device, dtype=dtype):
                out = forward(*args, **kwargs)
            return _as_float32(out)

        # an instance attribute over the forward in place (the class's, or one a hook set before), put back by disable
        self._den, self._previous = den, vars(den).get("forward")
        den.forward = autocast_forward

    def disable(self, backend):
        if self._previous is not None:
            self._den.forward = self._previous
        else:
            del self._den.forward


def native_cpu_dtype(dtype: str) -> bool:
    """Whether this CPU multiplies `dtype` ("bfloat16" / "float16") matrices natively (oneDNN's check)."""
    check = (
        torch.ops.mkldnn._is_mkldnn_bf16_supported
        if dtype == "bfloat16"
        else torch.ops.mkldnn._is_mkldnn_fp16_supported
    )
    try:
        return bool(check())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: no fast path either
        return False


def _as_float32(out):
    """A denoiser's output (a tensor, a tuple, or diffusers' output dataclass) with its floating tensors float32."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, tuple):
        return type(out)(_as_float32(x) for x in out)
    if isinstance(out, dict):  # diffusers' BaseOutput is an OrderedDict dataclass
        return type(out)(**{k: _as_float32(v) for k, v in out.items()})
    return out


# ------------------------------------------------------------------------------------------- lossy: step caches


class StepCache(Accelerator):
    """A diffusers cache hook, attached for one rollout call and removed after it. Applied with diffusers' own
    `apply_*` functions (what its CacheMixin's `enable_cache` calls), so that a denoiser without that mixin (SD3's,
    SANA's in diffusers 0.42) takes the caches too."""

    lossless = False
    hook_names: ClassVar[tuple[str, ...]] = ()  # the diffusers hooks it registers, removed after the rollout

    def config(self, knobs, num_steps: int):
        raise NotImplementedError

    def apply(self, den: torch.nn.Module, config) -> None:
        raise NotImplementedError

    @classmethod
    def problem(cls, backend):
        return cls.blocks_problem(_diffusers_model(backend))

    @classmethod
    def blocks_problem(cls, den) -> str | None:
        """The block-level caches need the transformer blocks as diffusers' hooks know them: a ModuleList named
        `transformer_blocks`, `blocks`, ... of block classes in its TransformerBlockRegistry."""
        from diffusers.hooks._helpers import TransformerBlockRegistry

        blocks = _block_list(den)
        if not blocks:
            return f"{type(den).__name__} has no list of transformer blocks that diffusers' cache hooks find"
        if len(blocks) < 2:
            return f"this {type(den).__name__} has one transformer block, and the cache needs a first and a last one"
        _register_blocks()
        unknown = sorted({type(b).__name__ for b in blocks if type(b) not in TransformerBlockRegistry._registry})
        if unknown:
            return f"diffusers' cache hooks do not know the block class {', '.join(unknown)} of {type(den).__name__}"
        return None

    def enable(self, backend, knobs, num_steps):
        from diffusers.hooks import HookRegistry

        den = _diffusers_model(backend)
        _register_blocks()
        self.apply(den, self.config(knobs, num_steps))
        HookRegistry.check_if_exists_or_initialize(den).invalidate_child_registries_cache()  # as enable_cache does
        self._handles = _name_every_call(den)

    def disable(self, backend):
        from diffusers.hooks import HookRegistry

        den = _diffusers_model(backend)
        for h in self._handles:
            h.remove()
        registry = HookRegistry.check_if_exists_or_initialize(den)
        for name in self.hook_names:  # the hooks (and their state) go: the next rollout starts afresh
            registry.remove_hook(name, recurse=True)
        registry.invalidate_child_registries_cache()


def _register_blocks() -> None:
    """Tell diffusers' block registry (what the block-level caches read: which output is the hidden states) about
    the blocks it leaves out: SANA's (one output, the hidden states). Once, and never over diffusers' own entry."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.sana_transformer import SanaTransformerBlock

    TransformerBlockRegistry._register()  # diffusers registers its block classes on first use
    if SanaTransformerBlock not in TransformerBlockRegistry._registry:
        TransformerBlockRegistry.register(
            SanaTransformerBlock,
            TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None),
        )


def _block_list(den: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks as diffusers' block-level caches collect them (its named ModuleLists, in order)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [
        b
        for n, m in den.named_children()
        if n in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(m, torch.nn.ModuleList)
        for b in m
    ]


def _name_every_call(den: torch.nn.Module) -> list:
    """Forward hooks that give each denoiser call a cache context, as a pipeline's `cache_context("cond")` does:
    named by the call's rows and its place within the step (a new step when the timestep changes), so that a
    family's separate unconditional pass, or a call over fewer rows (one per group), keeps a state of its own."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    seen = {"t": None, "k": 0}

    def timestep_of(args, kwargs):
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        return t.detach().flatten()[:1].cpu() if isinstance(t, torch.Tensor) else t

    def before(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        t = timestep_of(args, kwargs)
        same = seen["t"] is not None and t is not None and torch.equal(torch.as_tensor(seen["t"]), torch.as_tensor(t))
        seen["k"] = seen["k"] + 1 if same else 0
        seen["t"] = t
        rows = x.shape[0] if isinstance(x, torch.Tensor) else 0
        _set_cache_context(module, CacheContext(f"call{seen['k']}_rows{rows}"))

    def after(module, args, kwargs, output):
        _set_cache_context(module, None)

    return [
        den.register_forward_pre_hook(before, with_kwargs=True),
        den.register_forward_hook(after, with_kwargs=True),
    ]


@register
class FirstBlockCache(StepCache):
    name = "first_block_cache"
    summary = "diffusers' FirstBlockCache: skips the other blocks when the first block's residual barely changed"

    @dataclass
    class Knobs:
        threshold: float = 0.05
        """Relative change of the first block's residual below which the remaining blocks are skipped (their
        cached residual reused): higher = faster, further from the uncached sample."""

        def __post_init__(self):
            if not self.threshold >= 0:
                raise ValueError(f"threshold must be >= 0, got {self.threshold}")

    hook_names = ("fbc_leader_block_hook", "fbc_block_hook")

    @classmethod
    def blocks_problem(cls, den):
        if type(den).__name__ == "Flux2Transformer2DModel":  # measured: its hook fails on these blocks' outputs
            return "diffusers' FirstBlockCache fails on Flux2's blocks (a TypeError in its residuals); use mag_cache"
        why = super().blocks_problem(den)
        if why is None and len(_fbc_blocks(den)) < 2:
            return (
                f"this {type(den).__name__} has two transformer blocks, the last of them context_pre_only (it always "
                "runs), and the cache needs a first and a last one before it"
            )
        return why

    def config(self, knobs, num_steps):
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=knobs.threshold)

    def apply(self, den, config):
        """diffusers' `apply_first_block_cache` over `_fbc_blocks`: its hooks, its shared state."""
        from diffusers.hooks.first_block_cache import (
            FBCSharedBlockState,
            _apply_fbc_block_hook,
            _apply_fbc_head_block_hook,
        )
        from diffusers.hooks.hooks import StateManager

        blocks = _fbc_blocks(den)
        state = StateManager(FBCSharedBlockState, (), {})
        _apply_fbc_head_block_hook(blocks[0], state, config.threshold)
        for b in blocks[1:-1]:
            _apply_fbc_block_hook(b, state)
        _apply_fbc_block_hook(blocks[-1], state, is_tail=True)


def _fbc_blocks(den) -> list[torch.nn.Module]:
    """The blocks the first-block cache spans: all of them, except SD3's last block when it is `context_pre_only`
    (it returns no text stream, so diffusers' hook, which takes the text stream's residual at the last block, fails
    on it): that block then runs at every step, on the cached blocks' output."""
    blocks = _block_list(den)
    if blocks and getattr(blocks[-1], "context_pre_only", False):
        blocks = blocks[:-1]
    return blocks


@register
class TaylorSeerCache(StepCache):
    name = "taylorseer_cache"
    summary = "diffusers' TaylorSeer: predicts the blocks' outputs between full steps from their Taylor expansion"

    @dataclass
    class Knobs:
        cache_interval: int = 5
        """Steps between two full computations (the others are predicted)."""
        disable_cache_before_step: int = 3
        """The first steps are always computed in full (the warm-up)."""
        disable_cache_after_step: int | None = None
        """Steps from this one on are computed in full (null = none)."""
        max_order: int = 1
        """Order of the Taylor expansion."""
        use_lite_mode: bool = False
        """diffusers' lite mode: fewer modules predicted, less memory."""

        def __post_init__(self):
            if self.cache_interval < 1 or self.disable_cache_before_step < 0 or self.max_order < 0:
                raise ValueError("needs cache_interval >= 1, disable_cache_before_step >= 0 and max_order >= 0")

    hook_names = ("taylorseer_cache",)

    @classmethod
    def blocks_problem(cls, den):
        """It hooks the attention modules whose names match its patterns (`^transformer_blocks.*attn`, ...)."""
        import re

        from diffusers.hooks.taylorseer_cache import _TRANSFORMER_BLOCK_IDENTIFIERS

        if not any(re.fullmatch(p, n) for n, _ in den.named_modules() for p in _TRANSFORMER_BLOCK_IDENTIFIERS):
            return (
                f"no module of {type(den).__name__} has a name diffusers' TaylorSeer hooks "
                f"({', '.join(_TRANSFORMER_BLOCK_IDENTIFIERS)}), so it would predict nothing"
            )
        return None

    def apply(self, den, config):
        from diffusers.hooks import apply_taylorseer_cache

        apply_taylorseer_cache(den, config)

    def config(self, knobs, num_steps):
        from diffusers.hooks import TaylorSeerCacheConfig

        return TaylorSeerCacheConfig(
            cache_interval=knobs.cache_interval,
            disable_cache_before_step=knobs.disable_cache_before_step,
            disable_cache_after_step=knobs.disable_cache_after_step,
            max_order=knobs.max_order,
            taylor_factors_dtype=None,  # the model's dtype (diffusers' default, bfloat16, rounds float32 models)
            use_lite_mode=knobs.use_lite_mode,
        )


@register
class MagCache(StepCache):
    name = "mag_cache"
    summary = "diffusers' MagCache: skips steps while the calibrated magnitude ratios say the output barely changes"

    @dataclass
    class Knobs:
        mag_ratios: list[float] = field(default_factory=list)
        """The model's magnitude ratios, one per step of a calibration run (diffusers' `calibrate=True`); resampled
        to sample.num_steps. Required: they are the model's own."""
        threshold: float = 0.06
        """Accumulated error below which a step is skipped."""
        max_skip_steps: int = 3
        """Most steps skipped in a row."""
        retention_ratio: float = 0.2
        """The first fraction of the steps is never skipped."""

        def __post_init__(self):
            if len(self.mag_ratios) < 2:
                raise ValueError(
                    "needs mag_ratios, the model's calibrated magnitude ratios (one per step): "
                    "`flowrl calibrate CONFIG` measures them and prints the entry"
                )

    hook_names = ("mag_cache_leader_block_hook", "mag_cache_block_hook")

    def apply(self, den, config):
        from diffusers.hooks import apply_mag_cache

        apply_mag_cache(den, config)

    def config(self, knobs, num_steps):
        from diffusers.hooks import MagCacheConfig

        return MagCacheConfig(
            threshold=knobs.threshold,
            max_skip_steps=knobs.max_skip_steps,
            retention_ratio=knobs.retention_ratio,
            num_inference_steps=num_steps,
            mag_ratios=torch.tensor(knobs.mag_ratios, dtype=torch.float32),
        )


class MagRatios:
    """What `calibrating_mag_cache` collects: per rollout call and cache context (a call's conditional batch, a
    family's separate unconditional pass), the magnitude ratio of every step (MagCache's: the mean over tokens of
    |residual_t| / |residual_t-1| of the denoiser's blocks, 1.0 at the first step). `ratios()` averages them per
    step: the model's `mag_ratios`."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.runs: dict[int, list[float]] = {}  # id of a context's state -> its ratios so far (one per step)
        self.done: list[list[float]] = []

    def record(self, state) -> None:
        run = self.runs.setdefault(id(state), [])
        run.append(float(state.calibration_ratios[-1]))
        if len(run) == self.num_steps:
            self.done.append(self.runs.pop(id(state)))

    def ratios(self) -> list[float]:
        if not self.done:
            raise ValueError(
                f"no rollout of {self.num_steps} steps ran under the calibration (the calibration's num_steps must "
                "be the rollout's)"
            )
        return [sum(r[k] for r in self.done) / len(self.done) for k in range(self.num_steps)]


@contextlib.contextmanager
def calibrating_mag_cache(backend, num_steps: int):
    """diffusers' MagCache in calibration mode (it skips nothing and measures) on the backend's denoiser for the
    body, which runs rollouts of `num_steps` steps; yields a MagRatios whose `ratios()` are the model's
    `mag_ratios` for rollout.acceleration's mag_cache. A ValueError of one line where the family cannot take it."""
    from diffusers.hooks import HookRegistry, MagCacheConfig, apply_mag_cache
    from diffusers.hooks.mag_cache import MagCacheBlockHook

    why = MagCache.problem(backend)
    if why is not None:
        raise ValueError(f"mag_cache is not available for family {backend.family}: {why}")
    den = _diffusers_model(backend)
    _register_blocks()
    found = MagRatios(num_steps)
    cache = _instance(MagCache)
    apply_mag_cache(den, MagCacheConfig(calibrate=True, num_inference_steps=num_steps))
    HookRegistry.check_if_exists_or_initialize(den).invalidate_child_registries_cache()
    cache._handles = _name_every_call(den)
    try:
        tails = [
            hook
            for m in den.modules()
            if getattr(m, "_diffusers_hook", None) is not None
            for hook in [m._diffusers_hook.get_hook("mag_cache_block_hook")]
            if isinstance(hook, MagCacheBlockHook) and hook.is_tail
        ]
        for hook in tails:  # the tail block measures: record each step's ratio before diffusers resets the list
            original = hook._perform_calibration_step

            def measured(state, residual, original=original):
                original(state, residual)
                found.record(state)

            hook._perform_calibration_step = measured
        with _quiet_stdout():  # diffusers prints the ratios of every call
            yield found
    finally:
        cache.disable(backend)


@contextlib.contextmanager
def _quiet_stdout():
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        yield


class _TimestepCache(StepCache):
    """The caches diffusers drives from the pipeline's `current_timestep` (a callback into its loop)."""

    @classmethod
    def problem(cls, backend):
        return cls.unavailable()

    @classmethod
    def unavailable(cls):
        return (
            "it reads the timestep of diffusers' own pipeline loop (`current_timestep_callback`) and keys its "
            "skips to diffusers' 0-1000 timesteps, which flowrl's rollout recorder does not drive; use "
            "first_block_cache or taylorseer_cache"
        )

    def config(self, knobs, num_steps):  # pragma: no cover - never enabled (problem() refuses it)
        raise NotImplementedError


@register
class FasterCache(_TimestepCache):
    name = "faster_cache"
    summary = "diffusers' FasterCache (not available on flowrl's rollout loop: see its reason)"

    @dataclass
    class Knobs:
        spatial_attention_block_skip_range: int = 2
        """Reuse the spatial attention's output for this many steps."""


@register
class PyramidAttentionBroadcast(_TimestepCache):
    name = "pyramid_attention_broadcast"
    summary = "diffusers' pyramid attention broadcast (not available on flowrl's rollout loop: see its reason)"

    @dataclass
    class Knobs:
        spatial_attention_block_skip_range: int = 2
        """Reuse the spatial attention's output for this many steps."""


def knob_docs(name: str) -> list[tuple[str, Any, str]]:
    """(knob, default, doc) of accelerator `name`, for the docs."""
    from flowrl.config.tree import field_docs

    cls = ACCELERATORS.get(name).Knobs
    docs = field_docs(cls)
    return [
        (f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory(), docs.get(f.name, ""))
        for f in dataclasses.fields(cls)
    ]
