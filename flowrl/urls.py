"""The check of a server's URL that the config (text.vllm_url) and the remote reward (its url option) share."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit


def http_url_problem(url) -> Literal["host", "port"] | None:
    """What keeps `url` from being a server's address: "host" when it is not an http:// or https:// URL naming a
    host, "port" when its port is not a number from 1 to 65535 (urllib reads it only when a request is made, and
    then raises); None when it is one."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return "host"
    try:
        port = parts.port
    except ValueError:  # "abc", 99999
        return "port"
    return "port" if port == 0 else None
