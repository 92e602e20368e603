"""A reward server: scores images (or texts) with any registered reward or plug-in, over HTTP on the
standard library only (``ThreadingHTTPServer``; the wire format is in ``rewards/_wire.py``). Requests are
read concurrently but scored one at a time (one model, one device). Binds to loopback unless told otherwise.
Scores may be NaN or infinite: they are sent as ``NaN``/``Infinity``, which Python's json reads back.

    flowrl serve-reward pickscore --port 8000 --arg device=cuda:1 --arg scale=0.038
    flowrl serve-reward mypkg.scores:brightness --kind image   # a plug-in
    flowrl serve-reward pickscore --max-request-mb 256   # larger batches (default 64 MiB; 413 above the limit)
    rewards.get("remote", url="http://127.0.0.1:8000")   # the client
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from rewards._common import image_scores, invoke_text_reward, resolve_awaitable, text_scores
from rewards._wire import decode_png, to_jsonable
from rewards.registry import IMAGE, KINDS, RewardError, available, build, get, is_plugin, kind_of, load_plugin

_CHUNK = 1 << 20
MIB = 1 << 20
DEFAULT_MAX_REQUEST_MB = 64.0  # the largest request body by default (`--max-request-mb`): 413 above it


class RewardHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a listen backlog for bursts of clients (every rank of a run, or
    every sample's request at once) and daemon handler threads.

    socketserver's default backlog of 5 makes the kernel's SYN queue overflow under a burst of a few
    dozen connections on loopback: it answers with SYN cookies, then drops the completed handshakes the
    full accept queue cannot hold, and the clients' requests are answered with resets ("Connection reset
    by peer", 10 to 34 of 50 simultaneous clients here). The kernel caps the backlog at
    ``net.core.somaxconn`` (4096 on current Linux)."""

    request_queue_size = 1024
    daemon_threads = True


class RewardHTTPServerV6(RewardHTTPServer):
    """The same, on an IPv6 address such as ``::1``."""

    address_family = socket.AF_INET6


def make_server(
    reward: Callable[..., Any],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_request_bytes: int = int(DEFAULT_MAX_REQUEST_MB * MIB),
    name: str = "reward",
    quiet: bool = False,
    request_timeout: float = 120.0,
) -> RewardHTTPServer:
    """A server (not yet serving: call ``serve_forever``) for ``reward``; ``port=0`` picks a free port,
    read it back from ``server.server_address``. Requests over ``max_request_bytes`` get a 413 naming the limit and
    the flag that raises it (``--max-request-mb``)."""
    kind = kind_of(reward)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout  # seconds of silence before a connection is dropped

        def log_message(self, format: str, *args: Any) -> None:
            if not quiet:
                super().log_message(format, *args)

        def _warn(self, message: str) -> None:
            """One line on stderr, even when quiet: a reward that failed, or a client gone before its answer."""
            super().log_message("%s", " ".join(message.split()))

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError) as e:  # the client gave up waiting (its timeout)
                self.close_connection = True
                self._warn(f"{self.command} {self.path}: the client left before the answer ({type(e).__name__})")

        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/health":
                return self._send(404, {"error": f"unknown path {self.path!r}; GET /health or POST /score"})
            self._send(200, {"status": "ok", "reward": name, "kind": kind})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/score":
                return self._send(404, {"error": f"unknown path {self.path!r}; POST /score"})
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._send(411, {"error": "a Content-Length header is required"})
            if length > max_request_bytes:
                self._discard(length)
                self.close_connection = True
                return self._send(
                    413,
                    {
                        "error": f"request of {_mib(length)} exceeds the server's limit of {_mib(max_request_bytes)}; "
                        f"restart the server with a larger --max-request-mb, or send smaller batches"
                    },
                )
            try:
                request = json.loads(self.rfile.read(length))
                call = _parse_image_request(request) if kind == IMAGE else _parse_text_request(request)
            except (ValueError, TypeError, KeyError) as e:
                return self._send(400, {"error": f"bad request: {e}"})
            try:
                with lock:
                    answer = call(reward)
            except Exception as e:  # the reward failed: report it to the client and in the log, keep serving
                # (a built reward's RewardError names it already)
                message = str(e) if isinstance(e, RewardError) else f"{name} failed: {type(e).__name__}: {e}"
                self._warn(f"POST /score 500: {message}")
                return self._send(500, {"error": message})
            self._send(200, answer)

        def _discard(self, length: int) -> None:
            """Read and drop the body (so the client sees the 413 rather than a reset)."""
            try:
                while length > 0:
                    chunk = self.rfile.read(min(_CHUNK, length))
                    if not chunk:
                        break
                    length -= len(chunk)
            except OSError:
                pass

    server_class = RewardHTTPServerV6 if ":" in host else RewardHTTPServer  # ::1 is IPv6
    return server_class((host, port), Handler)


def _mib(n: int) -> str:
    return f"{n / MIB:.3g} MiB"


def _parse_image_request(request: dict[str, Any]) -> Callable[[Callable[..., Any]], dict[str, Any]]:
    images, prompts = request["images"], request["prompts"]
    metadata = request.get("metadata") or {}
    if not isinstance(images, list) or not isinstance(prompts, list) or not isinstance(metadata, dict):
        raise TypeError("'images' and 'prompts' must be lists and 'metadata' an object")
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    images = [decode_png(x) for x in images]

    def call(reward: Callable[..., Any]) -> dict[str, Any]:
        scores = image_scores(resolve_awaitable(reward(images, prompts, **metadata)), len(images), _name(reward))
        components = getattr(reward, "last_components", None) or {}
        return {"scores": to_jsonable(scores), "components": to_jsonable(dict(components))}

    return call


def _parse_text_request(request: dict[str, Any]) -> Callable[[Callable[..., Any]], dict[str, Any]]:
    prompts, completions = request["prompts"], request["completions"]
    columns = request.get("columns") or {}
    if not isinstance(prompts, list) or not isinstance(completions, list) or not isinstance(columns, dict):
        raise TypeError("'prompts' and 'completions' must be lists and 'columns' an object")

    def call(reward: Callable[..., Any]) -> dict[str, Any]:  # by keyword, as TRL calls a reward
        out = resolve_awaitable(invoke_text_reward(reward, {**columns, "prompts": prompts, "completions": completions}))
        return {"scores": to_jsonable(text_scores(out, len(completions), _name(reward)))}

    return call


def _name(reward: Callable[..., Any]) -> str:
    return getattr(reward, "__name__", type(reward).__name__)


def parse_reward_args(pairs: list[str], json_text: str | None) -> dict[str, Any]:
    """Reward options from ``--args-json '{...}'`` then ``--arg key=value`` (value read as JSON when it
    parses, e.g. numbers, true, null; else kept as a string)."""
    options: dict[str, Any] = {}
    if json_text:
        try:
            options = json.loads(json_text)
        except ValueError as e:
            example = '{"score": "strict"}'
            raise ValueError(f"--args-json is not JSON ({e}): give one object, e.g. '{example}'") from None
        if not isinstance(options, dict):
            raise ValueError(f"--args-json must be a JSON object, got {json_text!r}")
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--arg takes key=value, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowrl serve-reward", description="Serve a registered reward over HTTP (JSON, PNG images)."
    )
    parser.add_argument(
        "name",
        metavar="NAME",
        help="a registered reward (" + ", ".join(available()) + "), or a plug-in "
        "'package.module:function' or 'path/to/file.py:function'",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; 0.0.0.0 exposes the server to the network)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; default 8000)")
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_MB,
        help=f"largest request body, in MiB (default {DEFAULT_MAX_REQUEST_MB:g}); a larger one is answered 413",
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a reward option, repeatable; VALUE is read as JSON when it parses",
    )
    parser.add_argument("--args-json", default=None, metavar="JSON", help="reward options as one JSON object")
    parser.add_argument(
        "--kind",
        choices=KINDS,
        default=None,
        help="a plug-in's kind (default: its .kind attribute, else image); registered rewards know theirs",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="do not log each request (a reward's failures are still logged)"
    )
    return parser


def _build_served(name: str, options: dict[str, Any], kind: str | None) -> Callable[..., Any]:
    """The reward to serve: a registered one built as ``rewards.get`` does, or a plug-in built for
    ``kind`` (default: its own ``.kind``, else image)."""
    if not is_plugin(name):
        return get(name, **options)
    return build(name, options, kind or getattr(load_plugin(name), "kind", None) or IMAGE)


def serve_main(argv: list[str], *, on_ready: Callable[[RewardHTTPServer], None] | None = None) -> int:
    """``flowrl serve-reward NAME [--host] [--port] [--max-request-mb] [--arg k=v ...] [--args-json]``.

    Builds the reward, serves until interrupted and returns the exit code. ``on_ready(server)`` is
    called once the socket is bound (tests use it to read the port and to shut the server down).
    """
    args = build_parser().parse_args(argv)
    try:
        options = parse_reward_args(args.arg, args.args_json)
    except ValueError as e:
        print(f"flowrl serve-reward: {e}", file=sys.stderr)
        return 2
    if not args.max_request_mb > 0:
        print(f"flowrl serve-reward: --max-request-mb must be > 0, got {args.max_request_mb:g}", file=sys.stderr)
        return 2
    try:
        reward = _build_served(args.name, options, args.kind)
    except (ValueError, TypeError) as e:  # unknown name or option: the message lists the valid ones
        print(f"flowrl serve-reward: {e}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"flowrl serve-reward: --port must be 0 to 65535 (0 picks a free one), got {args.port}", file=sys.stderr)
        return 2
    try:
        server = make_server(
            reward,
            args.host,
            args.port,
            max_request_bytes=int(args.max_request_mb * MIB),
            name=args.name,
            quiet=args.quiet,
        )
    except OSError as e:  # the port is taken, the address is not this machine's, or it does not resolve
        print(
            f"flowrl serve-reward: cannot listen on {args.host}:{args.port}: {e.strerror or e}; give another "
            f"--port (0 picks a free one) or a --host of this machine (127.0.0.1, 0.0.0.0)",
            file=sys.stderr,
        )
        return 1
    host, port = server.server_address[:2]
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving on {args.host}, reachable from other machines; there is no authentication",
            file=sys.stderr,
        )
    print(
        f"serving reward {args.name!r} ({kind_of(reward)}) on http://{host}:{port}  (POST /score, GET /health; "
        f"requests up to {args.max_request_mb:g} MiB: --max-request-mb)",
        flush=True,
    )
    if on_ready is not None:
        on_ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
