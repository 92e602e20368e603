"""The reward registry: names -> factories, the two kinds of reward, rewards of other packages and of the user's code.

How to add a reward (e.g. ``rewards/shapes_geneval.py``)::

    from rewards.memory import NOTHING
    from rewards.registry import IMAGE, register

    @register("shapes_geneval", kind=IMAGE, memory=NOTHING,
              summary="the shapes world's GenEval-style check: the fraction of the prompt's clauses that hold")
    class ShapesGenEval:
        kind = IMAGE
        def __init__(self, threshold: float = 0.5): ...
        def __call__(self, images, prompts, **metadata) -> torch.Tensor: ...  # [B] float32

Every module of the ``rewards`` package (except those whose name starts with ``_``) is imported on
the first ``rewards.get`` / ``rewards.available`` call, so a new file registers itself; nothing else to
edit. A factory is any callable (a class or a function) whose keyword arguments are the reward's
options and which returns the reward callable:

- ``kind="image"``: ``reward(images: list[PIL.Image], prompts: list[str], **metadata) -> Tensor[B]``
  (float32, one score per image); extra named values per image go in ``reward.last_components``
  (``dict[str, Tensor[B]]``), refreshed on each call.
- ``kind="text"``: the TRL signature ``reward(prompts, completions, **columns) -> list[float | None]``;
  completions are strings or chat messages (lists of ``{"role", "content"}`` dicts).

A factory whose kind depends on its options (``remote``), or whose options name other rewards (``weighted``), has
``check_options(kwargs, kind) -> kind``, which ``check`` calls before any model loads.

What it holds on the accelerator: ``register(name, kind=..., memory=...)`` declares it for the memory planner
(``flowrl plan``): ``NOTHING``, or the model(s) it loads given its options, e.g.
``memory=hub_model("model", "CLIPModel")`` (see ``rewards/memory.py``); ``rewards.memory_spec(name, kwargs)``
answers. A reward that declares nothing is planned as "not estimated" (and tests/test_rewards_memory.py
fails for a reward of this package that does not declare).

What an image reward scores: ``register(name, kind=IMAGE, accepts=("video",))`` (or a ``.accepts`` attribute
on the reward or plug-in function) declares the samples it takes, ``"image"`` (PIL images, the default) and/or
``"video"`` (uint8 arrays of frames ``[F, H, W, C]``, see ``flowrl.video``). A video-native reward gets whole
clips; an image-only reward given videos scores ``video_frames`` frames of each, chosen evenly from the first to
the last, and each video's score is their mean (``video_aggregate``: mean, min or max), its components alike.

Rewards from other packages: a distribution declares entry points in the group ``flowrl.rewards``; each
entry point's name is a reward's name and its value a module (no ``:attribute``) that registers that reward
with ``rewards.register`` when imported, exactly as a file of this package does. In ``pyproject.toml``::

    [project.entry-points."flowrl.rewards"]
    their_name = "their_pkg.scores"        # their_pkg/scores.py: @register("their_name", kind=..., memory=...)

The module is imported the first time its reward is asked for (``get``, ``check``, ``build``,
``memory_spec``) or the rewards of a kind are listed (``available(kind)``); ``available()`` lists the names
without importing anything. A built-in name wins over an entry point of the same name. An entry point that
fails (its module does not import, or does not register its name) is a one-line RewardConfigError naming the
distribution and the entry point when its reward is asked for, and a warning (the reward left out) when the
rewards of a kind are listed; the other rewards are not affected.

Plug-ins: a reward named ``"package.module:function"`` or ``"path/to/file.py:function"`` (relative to
the working directory) is that function of the user's code, called on every batch with the config's
``kwargs`` as keyword arguments; its kind is the backend's unless it declares ``.kind`` (and ``.memory``,
as above, for the planner).
``check(name, kwargs, kind)`` validates any name without loading a model; ``build(name, kwargs, kind)``
returns the reward wrapped so that a failure names it.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from flowrl.core.registry import Registry, unknown_name_error
from flowrl.errors import FlowrlError
from rewards._common import (
    TRL_EXTRAS,
    accepted_kwargs,
    image_scores,
    invoke_text_reward,
    takes_batch_by_position,
    text_scores,
)
from rewards.memory import Held, NotEstimated, is_declaration, resolve

IMAGE = "image"
TEXT = "text"
KINDS = (IMAGE, TEXT)
VIDEO = "video"
SAMPLE_TYPES = (IMAGE, VIDEO)  # what an image-kind reward may accept

REWARDS: Registry[Callable[..., Any]] = Registry("reward")
ENTRY_POINT_GROUP = "flowrl.rewards"

PLUGIN_FORMS = "a plug-in 'package.module:function' or 'path/to/file.py:function'"
#: (module, function, option) of the plug-in options whose likely misspelling was warned about: said once a
#: process, not at each check and build
_SAID_MISSPELT: set[tuple[str | None, str, str]] = set()


class RewardConfigError(FlowrlError, ValueError):
    """A reward named in the config cannot be built as given: unknown name, bad option, wrong kind,
    or a plug-in that cannot be imported or called as a reward. A FlowrlError: the command line prints its line,
    and exits with a config error's code (2), as `flowrl serve-reward` does for the same mistakes."""

    exit_code = 2


class RewardError(FlowrlError, RuntimeError):
    """A built reward failed; the message starts with its name and the error is chained. A FlowrlError: the command
    line prints its one line (a failure of the reward's own code names the line it raised at)."""


#: the files whose frames are this package's wrapping of a reward call, not the reward's own code
_CALLING_FILES = {os.path.abspath(__file__), os.path.abspath(os.path.join(os.path.dirname(__file__), "_common.py"))}


def raised_at(error: BaseException) -> str:
    """Where `error` was raised in the reward's own code: ' (at FILE:LINE, in FUNCTION)' for the innermost frame of its
    traceback outside Python's and the installed packages' files (a plug-in's line, or a built-in reward's), else
    the innermost frame's (a reward installed as a package); '' without a traceback. FILE is relative to the
    working directory when it is under it."""
    import sysconfig

    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) not in _CALLING_FILES]
    if not frames:
        return ""
    libraries = {os.path.abspath(path) + os.sep for key, path in sysconfig.get_paths().items() if "lib" in key}
    own = [f for f in frames if not any(os.path.abspath(f.filename).startswith(lib) for lib in libraries)]
    frame = (own or frames)[-1]
    path = os.path.abspath(frame.filename)
    with contextlib.suppress(ValueError):  # another drive (Windows)
        relative = os.path.relpath(path)
        path = path if relative.startswith(os.pardir) else relative
    return f" (at {path}:{frame.lineno}, in {frame.name})"


def register(
    name: str,
    *,
    kind: str,
    accepts: tuple[str, ...] | None = None,
    memory: Any = None,
    summary: str = "",
    columns: tuple[str | tuple[str, ...], ...] = (),
    counts: tuple[str, ...] | None = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a reward factory under ``name``; ``kind`` is "image" or "text". An image reward's
    ``accepts`` says which samples it scores: ("image",) by default, ("video",) for a video-native one, or both.
    ``memory`` declares what it keeps on the accelerator, for the planner (``rewards.memory``: ``NOTHING``, held
    items, or a function of its options); None: not declared, so not estimated. ``summary``: what it scores, in
    one line (Markdown), for the docs' table of rewards (generated from the registry). ``columns``: the prompts'
    metadata columns it reads, each a name or a tuple of names of which one will do (``("solution", "answer")``);
    a run checks its prompt files for them before the model loads (a plug-in declares ``.columns``). ``counts``:
    the attributes a prompt leaves free that it counts per image, as ``free_<attribute>=<value>`` components
    (shapes_geneval's ``("color",)``), which train.dpo.pairing=matched pairs by; None when that depends on what
    it wraps (a reward server's or its parts'), so that only the run can tell (a plug-in declares ``.counts``)."""
    if kind not in KINDS:
        raise ValueError(f"reward {name!r}: kind must be one of {KINDS}, got {kind!r}")
    if accepts is not None:
        _check_accepts(name, accepts)
    columns = _check_columns(name, columns)
    counts = _check_counts(name, counts)
    if memory is not None and not is_declaration(memory):
        raise ValueError(
            f"reward {name!r}: memory must be NOTHING, a HubModel, Parameters or NotEstimated, a list "
            f"of them, or a function of the options giving them (see rewards.memory); got {memory!r}"
        )

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.reward_kind = kind  # type: ignore[attr-defined]
        if accepts is not None:
            factory.reward_accepts = tuple(accepts)  # type: ignore[attr-defined]
        if memory is not None:
            factory.reward_memory = memory  # type: ignore[attr-defined]
        factory.reward_summary = summary  # type: ignore[attr-defined]
        factory.reward_columns = columns  # type: ignore[attr-defined]
        factory.reward_counts = counts  # type: ignore[attr-defined]
        return REWARDS.register(name)(factory)

    return deco


def load_all() -> None:
    """Import every module of the ``rewards`` package once, so that each registers its rewards."""
    REWARDS.discover("rewards", [str(Path(__file__).parent)])  # (not `rewards.__path__`: no import cycle)


def available(kind: str | None = None) -> list[str]:
    """The reward names (sorted): built-in, registered and from entry points; optionally only those of one
    ``kind``, for which the entry points' modules are imported (one that fails is left out, with a warning)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    load_all()
    if kind is None:
        return sorted(set(REWARDS.names()) | set(_entry_points()))
    for name, entry_point in _entry_points().items():
        if name not in REWARDS:
            try:
                _load_entry_point(entry_point)
            except RewardConfigError as e:
                warnings.warn(str(e), stacklevel=2)
    return [n for n in REWARDS.names() if getattr(REWARDS.get(n), "reward_kind", None) == kind]


# ---------------------------------------------------------------------------- entry points


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The ``flowrl.rewards`` entry points of the distributions on ``sys.path`` now, by name (the first of a
    name). Read afresh on each call (a few milliseconds): a package put on the path later is seen."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, entry_point)
    return found


def _origin(entry_point: importlib.metadata.EntryPoint) -> str:
    """ "entry point NAME = VALUE (group flowrl.rewards) of distribution DIST VERSION"."""
    dist = getattr(entry_point, "dist", None)
    owner = f"distribution {dist.name} {dist.version}" if dist is not None else "an unnamed distribution"
    return f"entry point {entry_point.name} = {entry_point.value} (group {ENTRY_POINT_GROUP}) of {owner}"


def _load_entry_point(entry_point: importlib.metadata.EntryPoint) -> None:
    """Import the module an entry point names, which registers the reward of its name. A one-line
    RewardConfigError naming the distribution and the entry point when the value is not a module, its import
    fails, or it does not register that name."""
    name = entry_point.name
    if entry_point.attr:
        raise RewardConfigError(
            f"reward {name!r}: {_origin(entry_point)} names an attribute; its value must be a "
            f"module that calls rewards.register({name!r}, kind=...) on import: "
            f"{name} = {entry_point.module}"
        )
    before = set(REWARDS.names())
    try:
        importlib.import_module(entry_point.module)
    except Exception as e:  # ImportError, or the module's own code failed
        first = (str(e).strip().splitlines() or [""])[0]
        raise RewardConfigError(
            f"reward {name!r}: {_origin(entry_point)} failed to import: {type(e).__name__}: {first}"
        ) from e
    if name not in REWARDS:
        others = sorted(set(REWARDS.names()) - before)
        raise RewardConfigError(
            f"reward {name!r}: {_origin(entry_point)}: module {entry_point.module} registered "
            f"{', '.join(map(repr, others)) or 'nothing'}, not {name!r}; it must call "
            f"rewards.register({name!r}, kind=...)"
        )


def _factory(name: str) -> Callable[..., Any] | None:
    """The factory registered as ``name`` (an entry point's module imported first if need be); None when no
    reward has that name. RewardConfigError (see ``_load_entry_point``) when its entry point fails."""
    load_all()
    if name not in REWARDS:
        entry_point = _entry_points().get(name)
        if entry_point is None:
            return None
        _load_entry_point(entry_point)
    return REWARDS.get(name)


def _registered(name: str) -> Callable[..., Any]:
    """``_factory``, with a RewardConfigError listing the valid names (and the close ones) for an unknown name,
    and the plug-in forms."""
    factory = _factory(name)
    if factory is None:
        listed = str(unknown_name_error("reward", name, available())).rstrip(".")
        raise RewardConfigError(f"{listed}; or {PLUGIN_FORMS}.")
    return factory


def _options_message(name: str, unknown: list[str], valid: list[str]) -> str:
    """ "reward NAME got unknown option(s) ... Valid options: ..." with a did-you-mean for each."""
    close = [c for k in unknown for c in difflib.get_close_matches(k, valid, n=1, cutoff=0.6)]
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    return (
        f"reward {name!r} got unknown option(s) {', '.join(map(repr, unknown))}.{hint} "
        f"Valid options: {', '.join(valid) or '(none)'}."
    )


def get(name: str, **kwargs: Any) -> Callable[..., Any]:
    """Build the reward registered as ``name`` with its options ``kwargs``.

    The result carries ``.kind`` ("image" or "text") and ``.__name__`` (TRL logs rewards by it).
    An unknown name or option is an error that lists the valid ones.
    """
    factory = _registered(name)
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in params and not takes_any]
    if unknown:
        valid = [k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
        raise TypeError(_options_message(name, unknown, valid))
    reward = factory(**kwargs)
    if getattr(reward, "kind", None) is None:
        reward.kind = getattr(factory, "reward_kind", None)
    if getattr(reward, "accepts", None) is None and hasattr(factory, "reward_accepts"):
        reward.accepts = factory.reward_accepts
    if reward.kind not in KINDS:
        raise ValueError(f"reward {name!r} built a callable of kind {reward.kind!r}; valid kinds: {KINDS}")
    if not hasattr(reward, "__name__"):
        reward.__name__ = name
    return reward


def _check_accepts(name: str, accepts: Any) -> tuple[str, ...]:
    if isinstance(accepts, str):
        accepts = (accepts,)
    if not isinstance(accepts, (tuple, list)) or not accepts or any(a not in SAMPLE_TYPES for a in accepts):
        raise ValueError(f"reward {name!r}: accepts must be a non-empty tuple of {SAMPLE_TYPES}, got {accepts!r}")
    return tuple(accepts)


def accepts_of(reward: Callable[..., Any]) -> tuple[str, ...]:
    """The samples an image reward scores (its ``.accepts``): ("image",) when it does not say."""
    declared = getattr(reward, "accepts", None)
    return ("image",) if declared is None else _check_accepts(getattr(reward, "__name__", repr(reward)), declared)


def _check_columns(name: str, columns: Any) -> tuple[tuple[str, ...], ...]:
    """``columns`` as a tuple of alternatives (each a non-empty tuple of column names)."""
    problem = ValueError(
        f"reward {name!r}: columns must be a tuple of column names, each a name or a tuple of names of which one "
        f"will do, e.g. ('objects',) or (('solution', 'answer'),); got {columns!r}"
    )
    if isinstance(columns, str) or not isinstance(columns, (tuple, list)):
        raise problem
    out = []
    for entry in columns:
        names = (entry,) if isinstance(entry, str) else entry
        if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) and n for n in names):
            raise problem
        out.append(tuple(names))
    return tuple(out)


def declared_columns(name: str) -> tuple[tuple[str, ...], ...]:
    """The prompts' metadata columns the reward ``name`` (registered or a plug-in) says it reads, without building
    it: a tuple of alternatives, each a tuple of names of which one will do; () when it does not say."""
    if is_plugin(name):
        return _check_columns(name, getattr(load_plugin(name), "columns", ()))
    return tuple(getattr(_registered(name), "reward_columns", ()))


def _check_counts(name: str, counts: Any) -> tuple[str, ...] | None:
    """``counts`` as a tuple of attribute names, or None (not known before the reward runs)."""
    if counts is None:
        return None
    if (
        isinstance(counts, str)
        or not isinstance(counts, (tuple, list))
        or not all(isinstance(c, str) and c and "=" not in c and "/" not in c for c in counts)
    ):
        raise ValueError(
            f"reward {name!r}: counts must be a tuple of the free attributes it counts, e.g. ('color',) for "
            f"components 'free_color=<value>', or None when it cannot say before it runs; got {counts!r}"
        )
    return tuple(counts)


def declared_counts(name: str) -> tuple[str, ...] | None:
    """The free attributes the reward ``name`` (registered or a plug-in) says it counts per image (its
    ``free_<attribute>=<value>`` components), without building it: () when it counts none, None when it cannot
    say before it runs (a reward server, a weighted sum, a plug-in without ``.counts``)."""
    if is_plugin(name):
        return _check_counts(name, getattr(load_plugin(name), "counts", None))
    return getattr(_registered(name), "reward_counts", None)


def declared_accepts(name: str) -> tuple[str, ...]:
    """What the image reward ``name`` (registered or a plug-in) says it scores, without building it: its
    registration's ``accepts`` or the plug-in's ``.accepts``; ("image",) when it does not say."""
    if is_plugin(name):
        return accepts_of(load_plugin(name))
    return tuple(getattr(_registered(name), "reward_accepts", (IMAGE,)))


def kind_of(reward: Callable[..., Any], default: str | None = None) -> str:
    """The kind ("image"/"text") of a reward callable; ``default`` for unmarked ones (e.g. TRL's)."""
    kind = getattr(reward, "kind", default)
    if kind not in KINDS:
        raise ValueError(
            f"reward {getattr(reward, '__name__', reward)!r} has no kind (got {kind!r}); "
            f"set reward.kind to one of {KINDS} or build it with rewards.get(name)"
        )
    return kind


# ---------------------------------------------------------------------------- memory


def memory_spec(name: str, kwargs: Mapping[str, Any] | None = None) -> list[Held]:
    """What the reward ``name`` (registered, from an entry point, or a plug-in) with options ``kwargs`` keeps on
    the accelerator, for the memory planner: ``rewards.memory`` items (HubModel, Parameters, NotEstimated), each
    naming the reward it belongs to; [] when it holds no model. Nothing is built and no weights load (a
    plug-in's module is imported). A reward that declares nothing gives one NotEstimated saying so.
    RewardConfigError for an unknown name, a plug-in that cannot be loaded, or a declaration that fails on these
    options."""
    kwargs = dict(kwargs or {})
    if is_plugin(name):
        source = load_plugin(name)
        declared = getattr(source, "memory", None)
        missing = "a plug-in's function declares .memory"
    else:
        source = _registered(name)
        declared = getattr(source, "reward_memory", None)
        missing = "register(..., memory=...)"
    if declared is None:
        return [NotEstimated(f"it declares nothing ({missing}, see rewards.memory)", reward=name)]
    try:
        return resolve(declared, {**_defaults(source), **kwargs}, name)
    except RewardConfigError:
        raise
    except Exception as e:  # the declaration's function failed on these options, or gave something else
        raise RewardConfigError(
            f"reward {name!r}: its memory declaration failed on options {kwargs}: {type(e).__name__}: {e}"
        ) from e


def _defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """The parameters of ``fn`` that have a default value, with it ({} when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {k: p.default for k, p in params.items() if p.default is not p.empty}


# ---------------------------------------------------------------------------- check and build


def is_plugin(name: str) -> bool:
    """True for a plug-in name (``module:function`` or ``file.py:function``); registered names have no ':'."""
    return ":" in name


def check(name: str, kwargs: Mapping[str, Any], kind: str) -> None:
    """Validate a reward of the config without building it (no model is loaded): a registered ``name``
    must exist, be of ``kind`` and take ``kwargs``; a plug-in must import, name a function that takes
    ``kwargs`` and the batch of ``kind``. Raises RewardConfigError (a ValueError) with a one-line reason."""
    _checked(name, dict(kwargs or {}), kind)


def build(
    name: str, kwargs: Mapping[str, Any], kind: str, *, video_frames: int = 4, video_aggregate: str = "mean"
) -> "NamedReward":
    """The reward ``name`` with options ``kwargs``, for a backend of ``kind``, checked first (see
    ``check``) and wrapped in a ``NamedReward``: ``.kind``, ``.__name__ == name``, failures named.
    video_frames, video_aggregate: how an image-only reward scores a video (see ``NamedReward``)."""
    kwargs = dict(kwargs or {})
    video = dict(video_frames=video_frames, video_aggregate=video_aggregate)
    plugin = _checked(name, kwargs, kind)
    if plugin is not None:
        return NamedReward(plugin, name, kind, options=kwargs, **video)
    try:
        reward = get(name, **kwargs)
    except (ValueError, TypeError) as e:  # a bad option value, found by the reward itself
        raise RewardConfigError(f"reward {name!r}: {e}") from e
    except OSError as e:  # weights that are neither a local directory nor in the cache, and no hub to fetch from
        raise RewardError(_weights_message(name, kwargs, e)) from e
    except Exception as e:  # an optional package absent, ...
        raise RewardError(f"reward {name!r} could not be built: {type(e).__name__}: {e}") from e
    return NamedReward(reward, name, kind_of(reward), **video)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def weight_sources(name: str, kwargs: Mapping[str, Any]) -> dict[str, str]:
    """{option: value} of the options of registered reward `name` (its given kwargs over its defaults) that name
    weights: a local path that exists, or a hub id (ORG/NAME). A plug-in, or an unknown name: {}."""
    try:
        params = inspect.signature(_registered(name)).parameters
    except Exception:  # noqa: BLE001 - a plug-in or a name that `check` reports
        return {}
    named = {}
    for key, p in params.items():
        value = kwargs.get(key, p.default)
        if not isinstance(value, str) or key in ("device", "dtype"):
            continue
        if os.path.exists(os.path.expanduser(value)) or _HUB_ID.fullmatch(value):
            named[key] = value
    return named


def _weights_message(name: str, kwargs: dict[str, Any], error: OSError) -> str:
    """One line for a reward whose weights did not load: the options that name weights (a hub id or a directory)
    with their values, and how to give local copies; offline (HF_HUB_OFFLINE) says so."""
    first = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else ""
    head = f"reward {name!r} could not be built: {type(error).__name__}: {first}"
    named = weight_sources(name, kwargs)
    if not named:
        return head
    loads = ", ".join(f"{k}={v!r}" for k, v in named.items())
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    where = (
        "this machine is offline (HF_HUB_OFFLINE=1), so what is not in the Hugging Face cache cannot be downloaded"
        if offline
        else "what is not in the Hugging Face cache must be downloaded from the hub"
    )
    example = next(iter(named))
    return (
        f"{head}. It loads {loads}; {where}: run once with network access to cache them, or give local paths "
        f"in the reward's kwargs, e.g. kwargs: {{{example}: /path/to/dir}}"
    )


def _checked(name: str, kwargs: dict[str, Any], kind: str) -> Callable[..., Any] | None:
    """``check``; returns the plug-in's function (None for a registered name)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(name, str) or not name:
        raise RewardConfigError(f"a reward name is a registered name or {PLUGIN_FORMS}, got {name!r}")
    if is_plugin(name):
        return _check_plugin(name, kwargs, kind)
    check_registered(name, kwargs, kind)
    return None


def check_registered(name: str, kwargs: dict[str, Any], kind: str) -> None:
    """Name, options and kind of a registered reward, from its factory's signature (and its `check_options(kwargs,
    kind) -> kind` when the factory has one: a reward whose kind depends on its options, or whose options name other
    rewards); a RewardConfigError with a one-line reason."""
    factory = _factory(name)
    if factory is None:
        close = difflib.get_close_matches(name, available(), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise RewardConfigError(
            f"unknown reward {name!r}.{hint} Valid {kind} rewards: {', '.join(available(kind))}; or {PLUGIN_FORMS}."
        )
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    options = [k for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [k for k in kwargs if k not in options and not takes_any]
    if unknown:
        raise RewardConfigError(_options_message(name, unknown, options))
    missing = [
        k
        for k, p in params.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and k not in kwargs
    ]
    if missing:
        raise RewardConfigError(
            f"reward {name!r} needs option(s) {', '.join(map(repr, missing))} in its kwargs; "
            f"its options: {', '.join(options)}."
        )
    for k, value in kwargs.items():
        problem = _option_type_problem(name, k, value, params[k].default if k in params else None)
        if problem:
            raise RewardConfigError(problem)
    kind_check = getattr(factory, "check_options", None)
    actual = kind_check(kwargs, kind) if kind_check else factory.reward_kind
    if actual != kind:
        if "kind" in params:  # (remote: the kind of the server's reward is an option)
            raise RewardConfigError(
                f"reward {name!r} is {_a(actual)} reward (kwargs.kind: {actual}); this backend needs {kind} "
                f"rewards: set its kwargs.kind: {kind}, with a server of {_a(kind)} reward"
            )
        raise RewardConfigError(
            f"reward {name!r} is {_a(actual)} reward; this backend needs {kind} rewards: "
            f"{', '.join(available(kind))}, or {PLUGIN_FORMS} ({_a(actual)} run sets backend: {actual})."
        )


def _option_type_problem(name: str, key: str, value: Any, default: Any) -> str:
    """Why `value` does not suit option `key` whose default is a plain number, string or bool ("" when it does, or
    when the default says nothing: None, a list, no default): a number for a number (an int for an int), a string
    for a string, true/false for a bool."""
    if value is None or default is None or default is inspect.Parameter.empty:
        return ""
    if isinstance(default, bool):
        ok, what = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, what = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif isinstance(default, float):
        ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, what = isinstance(value, str), "a string"
    else:
        return ""
    if ok:
        return ""
    return f"reward {name!r}: option {key!r} takes {what} (its default is {default!r}), got {value!r}"


def _a(kind: str) -> str:
    """ "an image" / "a text"."""
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


# ---------------------------------------------------------------------------- plug-ins


def _check_plugin(name: str, kwargs: dict[str, Any], kind: str) -> Callable[..., Any]:
    """Import the plug-in ``name``, check it is a function of ``kind`` taking ``kwargs``; return it."""
    fn = load_plugin(name)
    declared = getattr(fn, "kind", None)
    if declared is not None and declared not in KINDS:
        raise RewardConfigError(f"reward {name!r} declares kind {declared!r}; valid kinds: {', '.join(KINDS)}")
    if declared is not None and declared != kind:
        raise RewardConfigError(
            f"reward {name!r} is {_a(declared)} reward (its .kind); this backend needs {kind} rewards"
        )
    if kind == IMAGE:
        try:
            accepts_of(fn)
        except ValueError as e:
            raise RewardConfigError(str(e)) from None
    _check_plugin_signature(name, fn, kwargs, kind)
    return fn


def load_plugin(name: str) -> Callable[..., Any]:
    """The function named by ``"package.module:function"`` or ``"path/to/file.py:function"`` (a dotted
    attribute path is followed). RewardConfigError naming the module or file and what failed."""
    target, _, attr = name.rpartition(":")
    if not target or not attr:
        raise RewardConfigError(f"reward {name!r}: {PLUGIN_FORMS} needs both parts around the ':'")
    module = _load_file(name, target) if _is_file(target) else _import_module(name, target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = _public_callables(module)
            close = difflib.get_close_matches(part, found, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise RewardConfigError(
                f"reward {name!r}: {target!r} has no attribute {attr!r}.{hint} "
                f"Its public callables: {', '.join(found) or '(none)'}."
            )
        obj = getattr(obj, part)
    if inspect.isclass(obj):
        raise RewardConfigError(
            f"reward {name!r} is a class; name the reward function, or an instance made in "
            f"the module (e.g. `{attr.lower()} = {attr}(...)`) whose __call__ scores a batch"
        )
    if not callable(obj):
        raise RewardConfigError(f"reward {name!r} is not callable (type {type(obj).__name__}); name a function")
    return obj


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _import_module(name: str, target: str) -> ModuleType:
    """``import target`` as Python would from the working directory (added to the end of sys.path)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    importlib.invalidate_caches()  # a module written since the last import attempt is found
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise RewardConfigError(
                f"reward {name!r}: module {target!r} not found (no module named {e.name!r} "
                f"on sys.path, which includes the working directory {cwd})"
            ) from None
        raise RewardConfigError(f"reward {name!r}: module {target!r} imports {e.name!r}, which is not installed") from e
    except SyntaxError as e:
        raise RewardConfigError(f"reward {name!r}: syntax error in {e.filename} line {e.lineno}: {e.msg}") from None
    except Exception as e:  # the module's own code failed at import
        raise RewardConfigError(
            f"reward {name!r}: importing module {target!r} raised {type(e).__name__}: {e}{_where(e)}"
        ) from e


def _load_file(name: str, target: str) -> ModuleType:
    """The module of a ``.py`` file (relative to the working directory), executed once per process."""
    path = Path(target).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if not path.is_file():
        raise RewardConfigError(f"reward {name!r}: file {target!r} not found (looked for {path})")
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"flowrl_plugin_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"reward {name!r}: {target!r} is not a Python file (give a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # as import does: dataclasses and pickle look the module up
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[module_name]
        raise RewardConfigError(f"reward {name!r}: syntax error in {target} line {e.lineno}: {e.msg}") from None
    except ModuleNotFoundError as e:
        del sys.modules[module_name]
        raise RewardConfigError(f"reward {name!r}: file {target!r} imports {e.name!r}, which is not installed") from e
    except Exception as e:
        del sys.modules[module_name]
        raise RewardConfigError(
            f"reward {name!r}: running file {target!r} raised {type(e).__name__}: {e}{_where(e)}"
        ) from e
    return module


def _where(error: BaseException) -> str:
    """ " (FILE line N)" of the innermost frame of ``error``'s traceback, or ""."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" ({frames[-1].filename} line {frames[-1].lineno})" if frames else ""


def _public_callables(module: ModuleType) -> list[str]:
    """Names of the functions and callable instances a module defines (imports and classes left out)."""
    names = []
    for key, value in vars(module).items():
        if key.startswith("_") or not callable(value) or inspect.isclass(value):
            continue
        if inspect.isfunction(value) and value.__module__ != module.__name__:
            continue  # imported
        if inspect.isbuiltin(value):
            continue
        names.append(key)
    return sorted(names)


def _var_keyword(params) -> str:
    return next(k for k, p in params.items() if p.kind is p.VAR_KEYWORD)


def _check_plugin_signature(name: str, fn: Callable[..., Any], kwargs: dict[str, Any], kind: str) -> None:
    """The options ``kwargs`` are parameters of ``fn``, and ``fn`` can take the batch of ``kind``: an image
    reward ``(images, prompts)`` positionally; a text reward ``completions`` (and ``prompts``) by keyword
    as TRL passes them, or its two first parameters positionally when none is named ``completions``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or extension function: nothing to read, trust it
    params = signature.parameters
    shown = f"{getattr(fn, '__name__', name.rpartition(':')[2])}{signature}"
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    batch = ("images", "prompts") if kind == IMAGE else ("prompts", "completions", "completion_ids", *TRL_EXTRAS)
    clash = [k for k in kwargs if k in batch]
    if clash:
        raise RewardConfigError(
            f"reward {name!r}: option(s) {', '.join(map(repr, clash))} would replace what every "
            f"{kind} reward is called with ({', '.join(batch)}); rename them"
        )
    by_position = kind == IMAGE or takes_batch_by_position(fn)
    slots = (
        [k for k, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        if by_position
        else []
    )
    keywordable = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    options = [k for k in keywordable if k not in batch and k not in slots]
    unknown = [k for k in kwargs if k not in options and not takes_any]
    if unknown:
        raise RewardConfigError(f"{_options_message(name, unknown, options)[:-1]} (signature {shown}).")
    for k in kwargs if takes_any else ():  # a **kwargs takes any option: one a letter off a parameter is a typo
        near = difflib.get_close_matches(k, [o for o in options if o not in kwargs], n=1, cutoff=0.75)
        said = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", name), k)
        if k not in options and near and said not in _SAID_MISSPELT:  # (the check and the build: said once)
            _SAID_MISSPELT.add(said)
            warnings.warn(
                f"reward {name!r}: option {k!r} is not a parameter of {shown}: it goes to its **{_var_keyword(params)}"
                f" and {near[0]!r} keeps its default; did you mean {near[0]!r}?",
                stacklevel=2,
            )
    call = (
        "f(images, prompts, **metadata)"
        if kind == IMAGE
        else "f(prompts=..., completions=..., **columns) (TRL's signature) or f(prompts, completions, **columns)"
    )
    problem = ""
    other = ("prompts", "completions") if kind == IMAGE else ("images", "prompts")
    if by_position and slots == list(other):
        problem = f" (its parameters {slots[0]}, {slots[1]} are {_a(TEXT if kind == IMAGE else IMAGE)} reward's)"
    elif by_position:
        try:
            signature.bind_partial(None, None, **kwargs)
        except TypeError as e:
            problem = f" ({e})"
        else:
            return
    elif ("completions" in keywordable or takes_any) and not any(
        p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in params.values()
    ):
        return
    raise RewardConfigError(
        f"reward {name!r}: {_a(kind)} reward is called as {call}, but its signature is {shown}{problem}"
    )


# ---------------------------------------------------------------------------- the built reward


def checked_components(components: Any, size: int, name: str) -> dict[str, Any]:
    """A reward's `last_components` as {name: float32 tensor [size]}: a mapping of per-sample numbers, one per
    sample of the call; a ValueError naming the reward and the component otherwise."""
    import torch

    if not isinstance(components, Mapping):
        raise ValueError(
            f"reward {name!r}: last_components is {type(components).__name__}, not a mapping of a name to one "
            f"number per sample"
        )
    out = {}
    for key, value in components.items():
        try:
            tensor = torch.as_tensor(value if isinstance(value, torch.Tensor) else np_asarray(value)).float()
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(
                f"reward {name!r}: last_components[{key!r}] is not numbers ({type(e).__name__}: {e})"
            ) from None
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu") if tensor.device.type != "meta" else None
        if tensor is None or tensor.numel() != size:
            shown = "a tensor on the meta device" if tensor is None else f"{tensor.numel()} values"
            raise ValueError(f"reward {name!r}: last_components[{key!r}] holds {shown} for a call of {size} samples")
        out[key] = tensor.reshape(-1)
    return out


def np_asarray(value: Any) -> Any:
    """`value` as a float64 numpy array (a list of numbers, numpy scalars, bools)."""
    import numpy as np

    return np.asarray(value, dtype=np.float64)


class NamedReward:
    """A built reward under the name it was configured with.

    Calls go to ``reward`` with ``options`` added as keyword arguments, and with only the keyword
    arguments (dataset columns, TRL's extras) that its signature accepts. A call that raises is re-raised
    as ``RewardError("reward 'NAME' failed: ...")`` (chained), a flowrl error (a reward server that is down) as it
    is; the output is checked and returned as
    ``Tensor[B]`` float32 (image) or ``list[float | None]`` (text). An async reward gives an awaitable,
    checked the same way when awaited. ``last_components`` and other attributes are the wrapped reward's.

    Videos (image kind): a batch of videos (uint8 arrays [F, H, W, C]) goes whole to a reward that accepts
    "video"; to an image-only reward go ``video_frames`` frames of each video (``flowrl.video.frame_indices``:
    evenly from the first to the last), as images, with each video's prompt and columns repeated per frame; the
    per-frame scores and components are reduced per video by ``video_aggregate`` (mean, min or max).
    """

    def __init__(
        self,
        reward: Callable[..., Any],
        name: str,
        kind: str,
        options: Mapping[str, Any] | None = None,
        *,
        video_frames: int = 4,
        video_aggregate: str = "mean",
    ):
        from flowrl.video import AGGREGATES

        self.reward = reward
        self.__name__ = name
        self.kind = kind
        self.options = dict(options or {})
        if video_frames < 1 or video_aggregate not in AGGREGATES:
            raise RewardConfigError(
                f"reward {name!r}: video_frames must be >= 1 and video_aggregate one of "
                f"{AGGREGATES}, got {video_frames} and {video_aggregate!r}"
            )
        self.video_frames, self.video_aggregate = int(video_frames), video_aggregate
        self.accepts = accepts_of(reward) if kind == IMAGE else ()
        self._frame_components: dict[str, Any] | None = None  # the last call's, when it scored frames
        try:  # the wrapped reward's signature, without the bound options: what callers may pass
            signature = inspect.signature(reward)
            self.__signature__ = signature.replace(
                parameters=[p for k, p in signature.parameters.items() if k not in self.options]
            )
        except (TypeError, ValueError):
            pass

    @property
    def last_components(self) -> dict[str, Any]:
        """The wrapped reward's extra per-sample values of its last call (per video when it scored frames)."""
        if self._frame_components is not None:
            return self._frame_components
        return getattr(self.reward, "last_components", None) or {}

    def __getattr__(self, attr: str) -> Any:  # url, health(), weights, ... of the wrapped reward
        if attr in ("reward", "__setstate__", "_frame_components"):  # not yet set (unpickling): no recursion
            raise AttributeError(attr)
        return getattr(self.reward, attr)

    def __repr__(self) -> str:
        return f"NamedReward({self.__name__!r}, kind={self.kind!r}, reward={self.reward!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        clash = sorted(set(kwargs) & set(self.options))
        if clash:
            raise RewardError(
                f"reward {self.__name__!r}: option(s) {', '.join(map(repr, clash))} also came as "
                f"call argument(s) (a dataset column of the same name?); rename the option"
            )
        size = self._batch_size(args, kwargs)
        self._frame_components = None
        if self.kind == IMAGE:
            videos = self._videos(args, kwargs)
            if videos and VIDEO not in self.accepts:
                return self._call_on_frames(args, kwargs)
        if self.kind == TEXT and len(args) > 2:
            raise TypeError(
                f"reward {self.__name__!r} takes (prompts, completions, **columns), got {len(args)} "
                f"positional arguments"
            )
        try:
            if self.kind == TEXT:  # by keyword as TRL does, or positionally if the reward names them otherwise
                out = invoke_text_reward(
                    self.reward, {**dict(zip(("prompts", "completions"), args)), **kwargs, **self.options}
                )
            else:
                out = self.reward(*args, **accepted_kwargs(self.reward, {**kwargs, **self.options}))
        except FlowrlError:  # a one-line error the user can act on (a reward server down): as it is
            raise
        except Exception as e:
            raise self._failure(e) from e
        if inspect.isawaitable(out):
            return self._finish(out, size)
        return self._scores(out, size)

    async def _finish(self, pending: Any, size: int | None) -> Any:
        try:
            out = await pending
        except FlowrlError:
            raise
        except Exception as e:
            raise self._failure(e) from e
        return self._scores(out, size)

    def _videos(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether the batch holds videos; a RewardError for a mixed batch, or images for a video-only reward."""
        from flowrl.video import is_video

        batch = args[0] if args else kwargs.get("images")
        if not isinstance(batch, (list, tuple)) or not batch:
            return False
        flags = {is_video(x) for x in batch}
        if len(flags) > 1:
            raise RewardError(f"reward {self.__name__!r}: a batch holds both images and videos; give one or the other")
        videos = flags.pop()
        if not videos and IMAGE not in self.accepts:
            raise RewardError(
                f"reward {self.__name__!r} scores videos (frames [F, H, W, C]) only; this model makes "
                f"images: use an image reward"
            )
        return videos

    def _call_on_frames(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """An image-only reward on a batch of B videos: it scores `video_frames` frames of each, with the video's
        prompt and per-sample columns repeated per frame; the result is per video."""
        from flowrl.video import sampled_frames

        args, kwargs = list(args), dict(kwargs)
        videos = args[0] if args else kwargs.pop("images")
        frames, counts = sampled_frames(list(videos), self.video_frames)

        def per_frame(value: Any) -> Any:  # a per-video list (prompts, a column) -> one entry per frame
            if isinstance(value, (list, tuple)) and len(value) == len(videos):
                return [v for v, n in zip(value, counts) for _ in range(n)]
            return value

        rest = [per_frame(a) for a in args[1:]]
        kwargs = {k: per_frame(v) for k, v in kwargs.items()}
        try:
            out = self.reward(frames, *rest, **accepted_kwargs(self.reward, {**kwargs, **self.options}))
        except Exception as e:
            raise self._failure(e) from e
        if inspect.isawaitable(out):
            return self._finish_frames(out, counts)
        return self._frame_scores(out, counts)

    async def _finish_frames(self, pending: Any, counts: list[int]) -> Any:
        try:
            out = await pending
        except FlowrlError:
            raise
        except Exception as e:
            raise self._failure(e) from e
        return self._frame_scores(out, counts)

    def _frame_scores(self, out: Any, counts: list[int]) -> Any:
        """Per-frame scores (and components) -> per video, by `video_aggregate`."""
        import torch

        from flowrl.video import aggregate

        try:
            scores = image_scores(out, sum(counts), self.__name__)
        except ValueError as e:
            raise RewardError(f"{e} (frames of {len(counts)} videos)") from None
        components = getattr(self.reward, "last_components", None) or {}
        self._frame_components = {
            name: torch.from_numpy(
                aggregate(torch.as_tensor(v, dtype=torch.float32).reshape(-1).numpy(), counts, self.video_aggregate)
            )
            for name, v in components.items()
        }
        return torch.from_numpy(aggregate(scores.numpy(), counts, self.video_aggregate))

    def _failure(self, error: Exception) -> RewardError:
        return RewardError(f"reward {self.__name__!r} failed: {type(error).__name__}: {error}{raised_at(error)}")

    def _batch_size(self, args: tuple, kwargs: dict[str, Any]) -> int | None:
        """Images (image kind) or completions (text kind) in the call, if they can be counted."""
        position, key = (0, "images") if self.kind == IMAGE else (1, "completions")
        batch = args[position] if len(args) > position else kwargs.get(key)
        return len(batch) if hasattr(batch, "__len__") else None

    def _scores(self, out: Any, size: int | None) -> Any:
        if size is None:
            return out
        try:
            if self.kind == IMAGE:
                scores = image_scores(out, size, self.__name__)
                components = getattr(self.reward, "last_components", None)
                if components:  # read by the trainer and the eval as [B] numbers each: checked here, named
                    self._frame_components = checked_components(components, size, self.__name__)
                return scores
            return text_scores(out, size, self.__name__)
        except ValueError as e:
            raise RewardError(str(e)) from None
