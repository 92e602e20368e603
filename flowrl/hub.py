"""The Hugging Face hub, reachable or not.

Without a network, huggingface_hub retries each request for about half a minute before it falls back to its cache,
and prints every retry. So before the first hub read of a run, flowrl tries once, for a few seconds, to open a
connection to the hub's endpoint (`HF_ENDPOINT`, by default https://huggingface.co); when that fails, it goes offline
for the rest of the process, as `HF_HUB_OFFLINE=1` would (huggingface_hub's setting, read by diffusers and
transformers; `datasets`' own copy; and the environment, read by the processes it starts), and says so in one line.
A model in the local cache then loads at once; one that is not fails at once, naming it. With HF_HUB_OFFLINE already
set, or a proxy configured (whose own connection flowrl does not second-guess), nothing is probed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
import warnings
from urllib.parse import urlsplit

TRUE = {"1", "ON", "YES", "TRUE"}
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
PROBE_SECONDS = 3.0

_probed: bool | None = None  # the probe's answer in this process (None: not probed yet)


def offline() -> bool:
    """Whether hub downloads are off: HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment
    says now, or set by `settle` in this process."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE


def why_offline() -> str:
    """Why hub downloads are off, for an error naming a model that is not in the cache."""
    if _probed is False:
        host, port = endpoint()
        return f"the hub ({host}:{port}) cannot be reached"
    return "HF_HUB_OFFLINE=1 forbids downloading it"


def endpoint() -> tuple[str, int]:
    """(host, port) of the hub's endpoint (HF_ENDPOINT)."""
    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def reachable(timeout: float = PROBE_SECONDS) -> bool:
    """Whether a TCP connection to the hub's endpoint opens within `timeout` seconds."""
    try:
        with socket.create_connection(endpoint(), timeout=timeout):
            return True
    except OSError:  # no DNS, no route, refused, timed out
        return False


def go_offline(reason: str) -> None:
    """Hub downloads off for the rest of this process and the processes it starts, with a one-line warning."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    datasets_config = sys.modules.get("datasets.config")  # (`datasets` reads the variable when it is imported)
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    warnings.warn(
        f"{reason}: models are read from the local Hugging Face cache only (as HF_HUB_OFFLINE=1)", stacklevel=3
    )


def settle() -> bool:
    """Before a hub read: whether the process is offline, probing the endpoint once (see the module docstring) and
    going offline when it cannot be reached."""
    global _probed
    if offline():
        return True
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return False
    if _probed is None:
        _probed = reachable()
        if not _probed:
            host, port = endpoint()
            go_offline(f"the Hugging Face hub ({host}:{port}) cannot be reached")
    return offline()


def settle_for(*paths: str) -> bool:
    """`settle` before loading `paths` when one names a hub model (not a local file or directory); whether the
    process is offline."""
    if all(os.path.exists(os.fspath(p)) for p in paths):
        return offline()
    return settle()


def _bar_switches() -> list[tuple]:
    """(is_on, turn_on, turn_off) of each installed library's loading bars."""
    out = []
    for module, is_on, on, off in (
        ("diffusers.utils.logging", "is_progress_bar_enabled", "enable_progress_bar", "disable_progress_bar"),
        ("transformers.utils.logging", "is_progress_bar_enabled", "enable_progress_bar", "disable_progress_bar"),
        ("huggingface_hub.utils", "are_progress_bars_disabled", "enable_progress_bars", "disable_progress_bars"),
    ):
        try:
            lib = importlib.import_module(module)
        except ImportError:  # (a text-only install without diffusers)
            continue
        check = getattr(lib, is_on)
        shown = (lambda c=check: not c()) if is_on.startswith("are_") else check
        out.append((shown, getattr(lib, on), getattr(lib, off)))
    return out


@contextlib.contextmanager
def loading_bars(enabled: bool):
    """Within it, the loading bars of diffusers, transformers and huggingface_hub ("Loading pipeline components",
    "Loading weights", downloads) are shown only when `enabled` (log.progress); each library's setting is put back
    after it."""
    if enabled:
        yield
        return
    switches = [(shown(), on, off) for shown, on, off in _bar_switches()]
    for _, _, off in switches:
        off()
    try:
        yield
    finally:
        for was, on, _ in switches:
            if was:
                on()
