"""A reward computed by a reward server (``flowrl serve-reward NAME``, see ``rewards/server.py``), e.g.
a large reward model on another GPU or machine. Images travel as PNG in JSON over HTTP.

A reply is checked before it is used: a body that is not a JSON object, no ``scores``, another number of
scores than samples, a score that is not a number (or null), or components of the wrong length raise
RewardServerError naming the server and what was wrong. NaN and infinities (which Python's json reads and
writes as ``NaN``/``Infinity``) pass through as floats; the trainer decides what to do with them.

A score request is never sent twice once the server has taken it: one not answered within ``timeout`` seconds
is an error saying to raise ``timeout`` (sending it again would score the batch again, behind the first). A
refused connection (no server on the port, e.g. one restarting) is tried again for up to ``connect_wait``
seconds; a reset, a cut reply or a 502/503/504 up to ``retries`` more times.

RewardServerError is a flowrl error: the command line prints it as one line. Before a run loads its model,
``check_server`` asks the server's ``GET /health`` (a few seconds, two tries), so that a server that is down, or
something else on its port, is reported at once."""

from __future__ import annotations

import http.client
import inspect
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

import torch

from flowrl.errors import FlowrlError
from flowrl.urls import http_url_problem
from rewards._common import TRL_EXTRAS, check_images
from rewards._wire import encode_png, to_jsonable
from rewards.memory import NOTHING
from rewards.registry import IMAGE, KINDS, register

# transient, retried (with what each means, for the error): any other error status is raised at once
RETRY_STATUS = {502: "bad gateway", 503: "busy or unavailable", 504: "gateway timeout"}
DEFAULT_CONNECT_WAIT = 120.0  # seconds: long enough for a reward server to restart and load its model
CONNECT_BACKOFF_CAP = 5.0  # at most this long between tries: a restarted server is used within 5 s of coming up


class RewardServerError(FlowrlError, RuntimeError):
    """The reward server answered with an error or a malformed reply, or could not be reached (one line naming
    its URL and what was wrong)."""


def backoff_delays(retries: int, backoff: float) -> list[float]:
    """Seconds to wait before each retry: ``backoff · 2^i`` for ``i = 0 .. retries-1``."""
    return [backoff * 2**i for i in range(retries)]


def connect_delays(wait: float, backoff: float, cap: float = CONNECT_BACKOFF_CAP) -> Iterator[float]:
    """Seconds to wait before each new try of a refused connection: ``backoff · 2^i``, at most ``cap``, the last
    cut short so that they add up to ``wait`` (none for 0). A generator: a long ``wait`` makes no long list."""
    remaining, i = wait, 0
    while remaining > 0:
        delay = min(backoff * 2 ** min(i, 60), cap, remaining)  # (2^60: no float overflow on a long wait)
        yield delay
        remaining -= delay  # exactly 0 after the last, cut-short delay
        i += 1


def check_url_and_kind(url: str, kind: str) -> None:
    """ValueError unless ``url`` looks like ``http(s)://HOST[:PORT]`` (a port 1 to 65535) and ``kind`` is a reward
    kind."""
    if kind not in KINDS:
        raise ValueError(f"remote reward kind must be one of {KINDS}, got {kind!r}")
    problem = http_url_problem(url)  # (the port read now: "abc" or 99999 would make urlopen raise mid-run)
    if problem == "host":
        raise ValueError(f"remote reward url must look like http://HOST:PORT, got {url!r}")
    if problem == "port":
        raise ValueError(f"remote reward url's port must be a number from 1 to 65535, got {url!r}")


def check_timing(timeout: Any, retries: Any, backoff: Any, connect_wait: Any) -> None:
    """ValueError naming the option unless ``timeout`` and ``backoff`` are seconds > 0 (a socket's timeout of 0
    would make it non-blocking), ``connect_wait`` seconds >= 0 and ``retries`` a whole number >= 0."""
    for key, value in (("timeout", timeout), ("backoff", backoff)):
        if not _seconds(value) or value == 0:
            raise ValueError(f"remote reward {key} must be a number of seconds > 0, got {value!r}")
    if not _seconds(connect_wait):
        raise ValueError(f"remote reward connect_wait must be a number of seconds >= 0, got {connect_wait!r}")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"remote reward retries must be a whole number >= 0 (0: no retry), got {retries!r}")


def _seconds(value: Any) -> bool:
    """A finite number >= 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@register(
    "remote",
    kind=IMAGE,
    memory=NOTHING,
    counts=None,
    summary="a reward computed by a reward server (`flowrl serve-reward`)",
)  # the server holds its models
class RemoteReward:
    """Calls ``POST {url}/score``; the kind ("image" or "text") must match the server's reward.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds for one request (connect + answer), > 0. A score request not answered in time is not sent
            again (the server may still be scoring it): give a slow reward model a larger timeout.
        retries: further attempts after a reset or cut connection or a 502/503/504 (and after a timed-out
            ``GET /health``), waiting ``backoff · 2^i`` seconds before attempt ``i + 2``; >= 0.
        backoff: seconds before the first retry, > 0.
        connect_wait: seconds a refused connection (no server on the port, e.g. one restarting) is tried again
            for, waiting ``backoff · 2^i`` seconds, at most 5, between tries; >= 0 (0: not tried again).
        kind: "image" (the default) or "text".
    """

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        kind: str = IMAGE,
        connect_wait: float = DEFAULT_CONNECT_WAIT,
    ):
        check_url_and_kind(url, kind)
        check_timing(timeout, retries, backoff, connect_wait)
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff, self.kind = timeout, retries, backoff, kind
        self.connect_wait = connect_wait
        self.last_components: dict[str, torch.Tensor] = {}

    @staticmethod
    def check_options(kwargs: dict[str, Any], kind: str) -> str:
        """``rewards.check``'s hook: the options' url, kind, timeout, retries, backoff and connect_wait are valid
        (no request is made); returns the kind these options build."""
        from rewards.registry import RewardConfigError

        built = kwargs.get("kind", IMAGE)
        timing = {k: kwargs.get(k, v) for k, v in _timing_defaults().items()}
        try:
            check_url_and_kind(kwargs.get("url"), built)
            check_timing(**timing)
        except ValueError as e:
            raise RewardConfigError(f"reward 'remote': {e}") from None
        return built

    def __call__(self, *args, **kwargs):
        """``(images, prompts, **metadata) -> Tensor[B]`` or ``(prompts, completions, **columns) -> list``,
        positionally or by keyword."""
        if self.kind == IMAGE:
            return self._score_images(*args, **kwargs)
        return self._score_texts(*args, **kwargs)

    def _score_images(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, f"remote reward {self.url}")
        payload = {
            "images": [encode_png(x) for x in images],
            "prompts": list(prompts),
            "metadata": to_jsonable(metadata, "metadata"),
        }
        answer = self.post("/score", payload)
        scores = self._scores(answer, len(images), "images")
        self.last_components = self._components(answer, len(images))
        return torch.tensor([math.nan if s is None else s for s in scores], dtype=torch.float32)

    def _score_texts(self, prompts, completions, **columns) -> list[float | None]:
        columns = {k: v for k, v in columns.items() if k not in TRL_EXTRAS}  # the trainer's objects stay here
        payload = {
            "prompts": to_jsonable(list(prompts), "prompts"),
            "completions": to_jsonable(list(completions), "completions"),
            "columns": to_jsonable(columns, "columns"),
        }
        return self._scores(self.post("/score", payload), len(completions), "completions")

    def _malformed(self, problem: str) -> RewardServerError:
        return RewardServerError(f"reward server {self.url} sent a malformed reply: {problem}")

    def _scores(self, answer: dict[str, Any], n: int, what: str) -> list[float | None]:
        """``answer["scores"]`` as ``n`` floats (None for null), or RewardServerError saying what is wrong."""
        if "scores" not in answer:
            raise self._malformed(f"no 'scores' (keys: {', '.join(map(repr, answer)) or 'none'})")
        return self._numbers(answer["scores"], n, what, "scores")

    def _components(self, answer: dict[str, Any], n: int) -> dict[str, torch.Tensor]:
        """``answer["components"]`` as float32 ``[n]`` tensors (NaN for null)."""
        components = answer.get("components") or {}
        if not isinstance(components, dict):
            raise self._malformed(f"'components' is a {_json_type(components)}, not an object of lists")
        parsed = {k: self._numbers(v, n, "images", f"components[{k!r}]") for k, v in components.items()}
        return {
            k: torch.tensor([math.nan if x is None else x for x in values], dtype=torch.float32)
            for k, values in parsed.items()
        }

    def _numbers(self, values: Any, n: int, what: str, where: str) -> list[float | None]:
        if not isinstance(values, list):
            raise self._malformed(f"{where} is a {_json_type(values)}, not a list of numbers")
        if len(values) != n:
            raise self._malformed(f"{where} has {len(values)} values for {n} {what}")
        for i, value in enumerate(values):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise self._malformed(f"{where}[{i}] is {value!r} ({_json_type(value)}), not a number")
        return [None if v is None else float(v) for v in values]

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (name and kind of its reward)."""
        return self._request(urllib.request.Request(self.url + "/health"))

    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(
            self.url + path, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        return self._request(request)

    def _request(self, request: urllib.request.Request) -> dict[str, Any]:
        """The JSON object the server answers. Tried again: a refused connection for up to ``connect_wait`` seconds,
        a reset, a cut reply or a 502/503/504 ``retries`` times, and a request sent but not answered in time only
        when it is a GET (a POST /score would be scored again, behind the first)."""
        refused_waits = connect_delays(self.connect_wait, self.backoff)
        delays = iter(backoff_delays(self.retries, self.backoff))
        attempts, waited = 0, 0.0
        while True:
            attempts += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return self._decode(response.read())
            except urllib.error.HTTPError as e:
                message = _error_message(e)
                if e.code not in RETRY_STATUS:
                    raise RewardServerError(f"reward server {self.url} answered {e.code}: {message}") from None
                last = ("status", f"{e.code} ({RETRY_STATUS[e.code]}): {message}")
            except urllib.error.URLError as e:  # before the request was sent: refused, unreachable, timed out
                kind = "refused" if isinstance(e.reason, ConnectionRefusedError) else "connection"
                last = (kind, _describe(e.reason))
            except TimeoutError:  # sent and taken, not answered in time: the server may be scoring it still
                if request.get_method() == "POST":
                    raise RewardServerError(self._too_slow()) from None
                last = ("timeout", "")
            except (OSError, http.client.IncompleteRead) as e:  # reset or cut: the server went away while answering
                last = ("connection", _describe(e))
            except http.client.HTTPException as e:  # not HTTP at all: retrying will not help
                raise self._malformed(f"not HTTP ({type(e).__name__}: {e})") from None
            delay = next(refused_waits if last[0] == "refused" else delays, None)
            if delay is None:
                raise RewardServerError(self._gave_up(request, last, attempts, waited))
            time.sleep(delay)
            waited += delay

    def _too_slow(self) -> str:
        return (
            f"reward server {self.url} did not answer a score request within timeout={self.timeout:g} s; it took the "
            f"request and may still be scoring it, so it is not sent again (that would score the batch twice): "
            f"raise the remote reward's timeout kwarg for a slow reward model or a large batch"
        )

    def _gave_up(self, request: urllib.request.Request, last: tuple[str, str], attempts: int, waited: float) -> str:
        """The error after the last try; ``last`` is what it met: ("status", "503 (...): message"), ("timeout", "")
        for a GET, or ("refused" or "connection", "TypeName: message")."""
        what, detail = last
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}, {waited:g} s of waiting in all"
        if what == "status":
            return f"reward server {self.url} answered {detail} ({tries})"
        if what == "timeout":
            path = urllib.parse.urlparse(request.full_url).path
            return f"reward server {self.url} did not answer GET {path} within {self.timeout:g} s ({tries})"
        port = urllib.parse.urlparse(self.url).port or "PORT"
        return (
            f"reward server {self.url} is not answering ({tries}; last: {detail}). "
            f"Is the server running? Start it with: flowrl serve-reward NAME --port {port}"
        )

    def _decode(self, body: bytes) -> dict[str, Any]:
        """The JSON object of a reply body (NaN and Infinity are read as floats)."""
        try:
            answer = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise self._malformed(f"not JSON ({e}); it begins {body[:60]!r}") from None
        if not isinstance(answer, dict):
            raise self._malformed(f"a JSON {_json_type(answer)}, not an object")
        return answer


def check_server(url: str, kind: str = IMAGE, *, timeout: float = 5.0, retries: int = 1) -> dict[str, Any]:
    """The server's ``GET /health`` answer, checked to come from a reward server of ``kind``: a cheap check before
    a run loads its model. RewardServerError (one line naming ``url``) when it does not answer in ``retries + 1``
    tries of ``timeout`` seconds, answers something else, or serves the other kind."""
    # connect_wait 0.5 (= backoff): a refused connection is tried twice, too, not waited for as a run would
    client = RemoteReward(url, timeout=timeout, retries=retries, backoff=0.5, kind=kind, connect_wait=0.5)
    answer = client.health()
    served = answer.get("kind")
    if answer.get("status") != "ok" or served not in KINDS:
        raise client._malformed(f"GET /health gave {json.dumps(answer)[:120]}, not a flowrl reward server's status")
    if served != kind:
        raise RewardServerError(
            f"reward server {client.url} serves {_a(served)} reward ({answer.get('reward')!r}); "
            f"this remote reward is of kind {kind!r} (set its kind option, or serve {_a(kind)} reward)"
        )
    return answer


def server_urls(name: str, options: dict[str, Any]) -> list[tuple[str, str]]:
    """The (url, kind) of each reward server a configured reward calls: ``remote`` itself, or the ``remote``
    components of a ``weighted`` reward."""
    if name == "remote":
        return [(options.get("url"), options.get("kind", IMAGE))]
    if name != "weighted" or not isinstance(options.get("components"), dict):
        return []
    found = []
    for key, spec in options["components"].items():
        if isinstance(spec, dict) and spec.get("reward", key) == "remote":
            found.append((spec.get("url"), spec.get("kind", IMAGE)))
    return found


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _timing_defaults() -> dict[str, Any]:
    """RemoteReward's defaults of timeout, retries, backoff and connect_wait."""
    params = inspect.signature(RemoteReward.__init__).parameters
    return {k: params[k].default for k in ("timeout", "retries", "backoff", "connect_wait")}


def _describe(error: BaseException) -> str:
    """``TypeName: message`` of a connection error."""
    return f"{type(error).__name__}: {error}"


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's ``{"error": ...}`` message, on one line."""
    try:
        message = json.loads(error.read()).get("error", error.reason)
    except (ValueError, OSError, AttributeError):
        message = error.reason
    return " ".join(str(message).split())


def _a(kind: str) -> str:
    """'an image' / 'a text': the article before a reward kind."""
    return f"{'an' if str(kind)[:1].lower() in 'aeiou' else 'a'} {kind}"
