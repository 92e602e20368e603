"""A reward computed by a reward server (``flowrl serve-reward NAME``, see ``rewards/server.py``), e.g.
a large reward model on another GPU or machine. Images travel as PNG in JSON over HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import torch

from rewards._common import check_images
from rewards._wire import encode_png, to_jsonable
from rewards.registry import IMAGE, KINDS, register

RETRY_STATUS = (502, 503, 504)  # transient: retried; any other error status is raised at once


class RewardServerError(RuntimeError):
    """The reward server answered with an error, or could not be reached."""


def backoff_delays(retries: int, backoff: float) -> list[float]:
    """Seconds to wait before each retry: ``backoff · 2^i`` for ``i = 0 .. retries-1``."""
    return [backoff * 2**i for i in range(retries)]


@register("remote", kind=IMAGE)
class RemoteReward:
    """Calls ``POST {url}/score``; the kind ("image" or "text") must match the server's reward.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds for one request (connect + answer).
        retries: further attempts after a connection error, a timeout or a 502/503/504,
            waiting ``backoff · 2^i`` seconds before attempt ``i + 2``.
        kind: "image" (the default) or "text".
    """

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5, kind: str = IMAGE):
        if kind not in KINDS:
            raise ValueError(f"remote reward kind must be one of {KINDS}, got {kind!r}")
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"remote reward url must look like http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff, self.kind = timeout, retries, backoff, kind
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, prompts_or_images, *args, **kwargs):
        if self.kind == IMAGE:
            return self._score_images(prompts_or_images, *args, **kwargs)
        return self._score_texts(prompts_or_images, *args, **kwargs)

    def _score_images(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, f"remote reward {self.url}")
        payload = {"images": [encode_png(x) for x in images], "prompts": list(prompts),
                   "metadata": to_jsonable(metadata, "metadata")}
        answer = self.post("/score", payload)
        scores = torch.tensor(answer["scores"], dtype=torch.float32)
        if scores.shape != (len(images),):
            raise RewardServerError(f"{self.url} returned {tuple(scores.shape)} scores for {len(images)} images")
        self.last_components = {k: torch.tensor(v, dtype=torch.float32)
                                for k, v in answer.get("components", {}).items()}
        return scores

    def _score_texts(self, prompts, completions, **columns) -> list[float | None]:
        payload = {"prompts": to_jsonable(list(prompts), "prompts"),
                   "completions": to_jsonable(list(completions), "completions"),
                   "columns": to_jsonable(columns, "columns")}
        return self.post("/score", payload)["scores"]

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (name and kind of its reward)."""
        return self._request(urllib.request.Request(self.url + "/health"))

    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(self.url + path, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        return self._request(request)

    def _request(self, request: urllib.request.Request) -> dict[str, Any]:
        delays = backoff_delays(self.retries, self.backoff)
        last_error = ""
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                message = _error_message(e)
                if e.code not in RETRY_STATUS:
                    raise RewardServerError(f"reward server {self.url} answered {e.code}: {message}") from None
                last_error = f"HTTP {e.code}: {message}"
            except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out, DNS
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                last_error = f"{type(reason).__name__}: {reason}"
            if attempt < self.retries:
                time.sleep(delays[attempt])
        raise RewardServerError(
            f"reward server {self.url} is not answering ({self.retries + 1} attempts, last: {last_error}). "
            f"Is it running? Start one with: flowrl serve-reward NAME --port PORT"
        )


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        return json.loads(error.read()).get("error", error.reason)
    except (ValueError, OSError, AttributeError):
        return str(error.reason)
