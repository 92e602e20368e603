"""The reward server and the remote reward, for real over loopback (servers on port 0, in threads)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from rewardtiny import NetworkBlockedError, block_non_loopback, random_images

import rewards
import rewards.remote as remote_module
from rewards.registry import IMAGE
from rewards.remote import RewardServerError, backoff_delays, connect_delays
from rewards.server import make_server, parse_reward_args, serve_main


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    block_non_loopback(monkeypatch)


class MeanPixel:
    """A reward whose value is easy to recompute: mean pixel / 255 + metadata["offset"]."""

    kind = IMAGE

    def __init__(self):
        self.last_components = {}

    def __call__(self, images, prompts, offset=0.0, **metadata):
        if prompts and prompts[0] == "fail":
            raise RuntimeError("the model ran out of memory")
        mean = torch.tensor([np.asarray(x, dtype=np.float64).mean() / 255 for x in images], dtype=torch.float32)
        self.last_components = {"prompt_chars": torch.tensor([float(len(p)) for p in prompts])}
        return mean + offset


@contextlib.contextmanager
def running_servers():
    """A `run(server) -> url` that serves each server in a thread; all are shut down on exit."""
    servers = []

    def run(server) -> str:
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    try:
        yield run
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def serve():
    with running_servers() as run:
        yield lambda reward, **kwargs: run(make_server(reward, "127.0.0.1", 0, quiet=True, **kwargs))


def test_remote_scores_equal_local_scores_and_carry_metadata_and_components(serve):
    url = serve(MeanPixel(), name="mean_pixel")
    remote = rewards.get("remote", url=url)
    images = random_images(3, (24, 16), seed=7)
    prompts = ["a", "bb", "ccc"]
    scores = remote(images, prompts, offset=torch.tensor(0.5))
    expected = [np.asarray(x, dtype=np.float64).mean() / 255 + 0.5 for x in images]  # PNG is lossless
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor(expected, dtype=torch.float32))
    assert remote.last_components["prompt_chars"].tolist() == [1.0, 2.0, 3.0]
    assert remote.health() == {"status": "ok", "reward": "mean_pixel", "kind": "image"}
    assert remote.kind == "image"


def test_remote_jpeg_matches_local_jpeg(serve):
    local = rewards.get("jpeg_incompressibility")
    remote = rewards.get("remote", url=serve(local) + "/")
    images = random_images(2, (32, 32), seed=8)
    torch.testing.assert_close(remote(images, ["x", "y"]), local(images, ["x", "y"]))
    torch.testing.assert_close(remote.last_components["jpeg_kb"], local.last_components["jpeg_kb"])


def test_text_reward_over_the_server(serve):
    remote = rewards.get("remote", url=serve(rewards.get("accuracy")), kind="text")
    completions = [r"\boxed{4}", [{"role": "assistant", "content": "5"}], "4"]
    assert remote(["q"] * 3, completions, solution=["4", "4", "pi"]) == [1.0, 0.0, None]


def test_request_over_the_size_limit_gets_413_naming_the_limit_and_the_flag(serve):
    remote = rewards.get("remote", url=serve(MeanPixel(), max_request_bytes=2000), retries=0)
    with pytest.raises(RewardServerError) as info:
        remote(random_images(2, (40, 40)), ["a", "b"])  # noise PNGs of ~5 kB each
    message = str(info.value)
    assert "\n" not in message and "answered 413: request of 0.0" in message
    assert "exceeds the server's limit of 0.00191 MiB; restart the server with a larger --max-request-mb" in message


def test_the_max_request_mb_flag_sets_the_limit(capsys):
    with serving(["jpeg_incompressibility", "--port", "0", "--quiet", "--max-request-mb", "0.002"]) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = rewards.get("remote", url=url, retries=0)
        with pytest.raises(RewardServerError, match=r"413: .* limit of 0\.002 MiB; .*--max-request-mb"):
            remote(random_images(2, (40, 40)), ["a", "b"])
        assert remote(random_images(1, (4, 4)), ["a"]).shape == (1,)  # a small request is served
    assert "requests up to 0.002 MiB: --max-request-mb" in capsys.readouterr().out
    assert serve_main(["jpeg_incompressibility", "--max-request-mb", "0"]) == 2
    assert "--max-request-mb must be > 0" in capsys.readouterr().err


def test_a_port_taken_or_out_of_range_and_bad_args_json_are_one_line(capsys):
    with serving(["jpeg_incompressibility", "--port", "0", "--quiet"]) as server:
        port = server.server_address[1]
        capsys.readouterr()
        assert serve_main(["jpeg_incompressibility", "--port", str(port)]) == 1
        err = capsys.readouterr().err.strip()
        assert (
            err.startswith(f"flowrl serve-reward: cannot listen on 127.0.0.1:{port}: ")
            and "--port (0 picks a free one)" in err
        )
        assert len(err.splitlines()) == 1
    assert serve_main(["jpeg_incompressibility", "--port", "99999"]) == 2
    assert "--port must be 0 to 65535" in capsys.readouterr().err
    assert serve_main(["jpeg_incompressibility", "--args-json", "{bad"]) == 2
    assert "--args-json is not JSON (" in capsys.readouterr().err


def test_reward_failure_is_reported_and_not_retried_and_logged_by_the_server(serve, monkeypatch, capsys):
    sleeps = []
    monkeypatch.setattr(remote_module.time, "sleep", sleeps.append)
    remote = rewards.get("remote", url=serve(MeanPixel(), name="mean_pixel"), retries=3)
    message = "500: mean_pixel failed: RuntimeError: the model ran out of memory"
    with pytest.raises(RewardServerError, match=message):
        remote(random_images(1), ["fail"])
    assert sleeps == []
    logged = capsys.readouterr().err.splitlines()  # written before the answer: here by now, even when quiet
    assert len(logged) == 1 and logged[0].endswith(f"POST /score {message}")
    assert remote(random_images(1), ["ok"]).shape == (1,)  # the server keeps serving


def test_bad_requests_get_400(serve):
    url = serve(MeanPixel())
    client = remote_module.RemoteReward(url, retries=0)
    with pytest.raises(RewardServerError, match="400: bad request: not a base64 PNG"):
        client.post("/score", {"images": ["bm90IGEgcG5n"], "prompts": ["a"]})
    with pytest.raises(RewardServerError, match="400: bad request: 1 images but 2 prompts"):
        client.post("/score", {"images": [remote_module.encode_png(random_images(1)[0])], "prompts": ["a", "b"]})


def test_backoff_schedule():
    assert backoff_delays(4, 0.5) == [0.5, 1.0, 2.0, 4.0]  # 0.5 * 2^i
    assert backoff_delays(0, 0.5) == []


def test_connect_schedule_is_capped_and_adds_up_to_the_wait():
    assert list(connect_delays(10, 0.5, cap=2)) == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5]
    assert list(connect_delays(0.5, 0.5)) == [0.5] and list(connect_delays(0, 0.5)) == []
    assert sum(connect_delays(120, 0.5)) == 120 and max(connect_delays(120, 0.5)) == 5.0  # the defaults
    assert next(iter(connect_delays(1e9, 0.5))) == 0.5  # lazy: no billion-item list


def test_server_down_is_a_clear_error_after_waiting_connect_wait(monkeypatch):
    port = _closed_port()
    sleeps = []
    monkeypatch.setattr(remote_module.time, "sleep", sleeps.append)
    remote = rewards.get("remote", url=f"http://127.0.0.1:{port}", retries=0, backoff=0.25, connect_wait=3)
    with pytest.raises(
        RewardServerError,
        match=rf"http://127.0.0.1:{port} is not answering \(5 attempts, 3 s of waiting in all; last: "
        r"ConnectionRefusedError.*flowrl serve-reward",
    ):
        remote(random_images(1), ["a"])
    assert sleeps == [0.25, 0.5, 1.0, 1.25]  # refusals are waited for although retries=0


def test_a_server_restarting_is_waited_for(monkeypatch):
    """Down for the first three tries (the old schedule of retries=3 gave up at the fourth refusal), then up."""
    port = _closed_port()
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 4:  # "restarted" between the 4th and 5th try: no clock involved
            run(make_server(MeanPixel(), "127.0.0.1", port, quiet=True))

    monkeypatch.setattr(remote_module.time, "sleep", sleep)
    remote = rewards.get("remote", url=f"http://127.0.0.1:{port}", retries=0, backoff=0.1, connect_wait=10)
    images = random_images(1, seed=3)
    with running_servers() as run:
        scores = remote(images, ["a"])
    torch.testing.assert_close(scores, torch.tensor([np.asarray(images[0], dtype=np.float64).mean() / 255]).float())
    assert sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8])


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"timeout": 0}, "timeout must be a number of seconds > 0, got 0"),
        ({"timeout": -5}, "timeout must be a number of seconds > 0, got -5"),
        ({"timeout": float("inf")}, "timeout must be a number of seconds > 0, got inf"),
        ({"retries": -1}, r"retries must be a whole number >= 0 \(0: no retry\), got -1"),
        ({"backoff": 0}, "backoff must be a number of seconds > 0, got 0"),
        ({"connect_wait": -1}, "connect_wait must be a number of seconds >= 0, got -1"),
        (
            {"url": "http://127.0.0.1:99999"},
            r"url's port must be a number from 1 to 65535, got 'http://127.0.0.1:99999'",
        ),
        ({"url": "http://127.0.0.1:abc"}, r"url's port must be a number from 1 to 65535, got 'http://127.0.0.1:abc'"),
        ({"url": "http://127.0.0.1:0"}, r"url's port must be a number from 1 to 65535, got 'http://127.0.0.1:0'"),
        ({"url": "http://:8000"}, r"url must look like http://HOST:PORT, got 'http://:8000'"),
    ],
)
def test_options_out_of_range_are_one_line_when_the_reward_is_built_or_checked(options, problem):
    from rewards.registry import RewardConfigError

    options = {"url": "http://127.0.0.1:8000", **options}
    with pytest.raises(ValueError, match=f"^remote reward {problem}$"):
        rewards.get("remote", **options)
    with pytest.raises(RewardConfigError, match=f"^reward 'remote': remote reward {problem}$"):
        rewards.check("remote", options, IMAGE)  # a run's config check, before any model loads


def test_transient_503_is_retried(monkeypatch):
    calls = []

    class Flaky(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(1)
            status, body = (503, {"error": "warming up"}) if len(calls) < 3 else (200, {"scores": [0.25]})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    sleeps = []
    monkeypatch.setattr(remote_module.time, "sleep", sleeps.append)
    try:
        remote = rewards.get("remote", url=f"http://127.0.0.1:{server.server_address[1]}", retries=2, backoff=0.1)
        assert remote(random_images(1), ["a"]).tolist() == [0.25]
    finally:
        server.shutdown()
        server.server_close()
    assert len(calls) == 3 and sleeps == [0.1, 0.2]


def test_503_to_every_try_says_the_server_answered_503_not_that_it_is_down(monkeypatch):
    monkeypatch.setattr(remote_module.time, "sleep", lambda s: None)

    class Busy(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = b'{"error": "warming up"}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    with running_servers() as run:
        url = run(ThreadingHTTPServer(("127.0.0.1", 0), Busy))
        remote = rewards.get("remote", url=url, retries=2, backoff=0.1)
        with pytest.raises(RewardServerError) as info:
            remote(random_images(1), ["a"])
    message = str(info.value)
    assert message.startswith(f"reward server {url} answered 503 (busy or unavailable): warming up (3 attempts, ")
    assert "not answering" not in message and "Is the server running" not in message


@contextlib.contextmanager
def serving(argv):
    """`serve_main(argv)` in a thread: yields the bound server; on exit shuts it down and checks it returned 0."""
    ready, holder, result = threading.Event(), [], []

    def on_ready(server):
        holder.append(server)
        ready.set()

    thread = threading.Thread(target=lambda: result.append(serve_main(argv, on_ready=on_ready)), daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield holder[0]
    finally:
        holder[0].shutdown()
        thread.join(10)
    assert result == [0]


def test_serve_main_serves_a_registered_reward_with_cli_options():
    with serving(["jpeg_incompressibility", "--port", "0", "--arg", "quality=80", "--quiet"]) as server:
        remote = rewards.get("remote", url=f"http://127.0.0.1:{server.server_address[1]}")
        images = random_images(2, (32, 32), seed=9)
        torch.testing.assert_close(
            remote(images, ["a", "b"]), rewards.get("jpeg_incompressibility", quality=80)(images, ["a", "b"])
        )
        assert remote.health()["reward"] == "jpeg_incompressibility"
        assert server.server_address[0] == "127.0.0.1"  # loopback by default


def test_serve_main_rejects_unknown_reward_and_bad_args(capsys):
    assert serve_main(["pickscor", "--port", "0"]) == 2
    assert "Did you mean 'pickscore'" in capsys.readouterr().err
    assert serve_main(["jpeg_compressibility", "--port", "0", "--arg", "nokey"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert serve_main(["jpeg_compressibility", "--port", "0", "--arg", "qualty=3"]) == 2
    assert "Valid options: quality" in capsys.readouterr().err


def test_parse_reward_args():
    assert parse_reward_args(["scale=0.5", "device=cuda:1", "flag=true", "x=null"], '{"model": "m", "scale": 2}') == {
        "model": "m",
        "scale": 0.5,
        "device": "cuda:1",
        "flag": True,
        "x": None,
    }


def test_network_guard_blocks_other_hosts_but_not_loopback():
    with pytest.raises(NetworkBlockedError, match="192.0.2.1"):
        socket.create_connection(("192.0.2.1", 80), timeout=1)  # TEST-NET-1: never reached
    with pytest.raises(NetworkBlockedError):
        socket.getaddrinfo("huggingface.co", 443)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        socket.create_connection(listener.getsockname(), timeout=1).close()


def test_a_slow_score_request_is_not_sent_again_and_a_slow_health_check_is(monkeypatch):
    release = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            release.wait(30)  # answers only after the client has given up

        do_GET = do_POST

    sent, sleeps = [], []
    urlopen = remote_module.urllib.request.urlopen
    monkeypatch.setattr(remote_module.urllib.request, "urlopen", lambda r, **kw: sent.append(r) or urlopen(r, **kw))
    monkeypatch.setattr(remote_module.time, "sleep", sleeps.append)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    with running_servers() as run:
        url = run(server)
        remote = rewards.get("remote", url=url, timeout=0.2, retries=2)
        try:
            with pytest.raises(RewardServerError) as info:
                remote(random_images(1), ["a"])
            assert len(sent) == 1 and sleeps == []  # a second POST would be scored again, behind the first
            assert str(info.value) == (
                f"reward server {url} did not answer a score request within timeout=0.2 s; it took the request and "
                "may still be scoring it, so it is not sent again (that would score the batch twice): raise the "
                "remote reward's timeout kwarg for a slow reward model or a large batch"
            )
            sent.clear()
            with pytest.raises(RewardServerError, match=rf"^reward server {url} did not answer GET /health within "):
                remote.health()
            assert len(sent) == 3  # a health check scores nothing: it is tried again
        finally:
            release.set()


def test_the_server_ignores_a_client_that_left_before_its_answer(capsys):
    """A client that timed out is gone when the reward finishes: one line, no BrokenPipeError traceback."""
    entered, release, done, errors = threading.Event(), threading.Event(), threading.Event(), []

    def slow(prompts, completions, **columns):
        entered.set()
        release.wait(30)
        return [1.0] * len(completions)

    slow.kind = "text"
    server = make_server(slow, "127.0.0.1", 0, quiet=True)
    server.handle_error = lambda request, address: errors.append(address)  # where the traceback was printed
    shutdown_request = server.shutdown_request
    server.shutdown_request = lambda request: (shutdown_request(request), done.set())  # the handler is done
    with running_servers() as run:
        run(server)
        body = json.dumps({"prompts": ["q"], "completions": ["x"]}).encode()
        client = socket.create_connection(server.server_address[:2], timeout=10)
        client.sendall(b"POST /score HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert entered.wait(30)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # with a reset, as a client gone: the server's first write fails
        release.set()
        assert done.wait(30)
    assert errors == []
    logged = capsys.readouterr().err
    assert "Traceback" not in logged and len(logged.splitlines()) == 1
    assert "POST /score: the client left before the answer (" in logged


class Garbage(BaseHTTPRequestHandler):
    """Answers every POST with 200 and the bytes in ``reply`` (set on a subclass)."""

    reply = b""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.reply)))
        self.end_headers()
        self.wfile.write(self.reply)


@pytest.fixture
def garbage_server():
    def start(reply: bytes) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), type("Reply", (Garbage,), {"reply": reply}))
        server.daemon_threads = True
        return run(server)

    with running_servers() as run:
        yield start


@pytest.mark.parametrize(
    "reply, kind, problem",
    [
        (
            b"<html>Bad Gateway</html>",
            "image",
            r"not JSON \(Expecting value: line 1 column 1 \(char 0\)\); it begins b'<html>",
        ),
        (b"[0.5, 0.5]", "image", r"a JSON list, not an object"),
        (b'{"score": [0.5, 0.5]}', "image", r"no 'scores' \(keys: 'score'\)"),
        (b'{"scores": "0.5 0.5"}', "text", r"scores is a string, not a list of numbers"),
        (b'{"scores": [0.5]}', "image", r"scores has 1 values for 2 images"),
        (b'{"scores": [0.5, 0.5, 0.5]}', "text", r"scores has 3 values for 2 completions"),
        (b'{"scores": [0.5, "high"]}', "image", r"scores\[1\] is 'high' \(string\), not a number"),
        (b'{"scores": [true, 1]}', "text", r"scores\[0\] is True \(boolean\), not a number"),
        (
            b'{"scores": [0.5, 0.5], "components": {"clip": [1.0]}}',
            "image",
            r"components\['clip'\] has 1 values for 2 images",
        ),
        (
            b'{"scores": [0.5, 0.5], "components": [1.0, 2.0]}',
            "image",
            r"'components' is a list, not an object of lists",
        ),
    ],
)
def test_malformed_replies_name_the_server_and_the_problem(garbage_server, monkeypatch, reply, kind, problem):
    sleeps = []
    monkeypatch.setattr(remote_module.time, "sleep", sleeps.append)
    url = garbage_server(reply)
    remote = rewards.get("remote", url=url, kind=kind, retries=2)
    batch = (random_images(2), ["a", "b"]) if kind == "image" else (["q", "q"], ["x", "y"])
    with pytest.raises(RewardServerError, match=rf"^reward server {url} sent a malformed reply: {problem}"):
        remote(*batch)
    assert sleeps == []  # a malformed reply is not retried


def test_non_finite_scores_pass_through_as_floats(garbage_server):
    url = garbage_server(b'{"scores": [NaN, Infinity, -Infinity, null, 2]}')
    texts = rewards.get("remote", url=url, kind="text")(["q"] * 4 + ["r"], ["a", "b", "c", "d", "e"])
    assert np.isnan(texts[0]) and texts[1:4] == [float("inf"), float("-inf"), None] and texts[4] == 2.0
    scores = rewards.get("remote", url=url)(random_images(5), ["p"] * 5)
    assert scores.dtype == torch.float32
    assert torch.isnan(scores[0]) and scores[1] == float("inf") and scores[2] == float("-inf")
    assert torch.isnan(scores[3]) and scores[4] == 2.0  # null: no score


def test_the_server_sends_non_finite_scores(serve):
    class NonFinite:
        kind = IMAGE

        def __call__(self, images, prompts, **metadata):
            return torch.tensor([float("nan"), float("inf"), -1.0])[: len(images)]

    scores = rewards.get("remote", url=serve(NonFinite()))(random_images(3), ["a", "b", "c"])
    assert torch.isnan(scores[0]) and scores[1:].tolist() == [float("inf"), -1.0]

    def text(prompts, completions, **columns):
        return [float("-inf"), None]

    text.kind = "text"
    out = rewards.get("remote", url=serve(text), kind="text")(["q", "q"], ["a", "b"])
    assert out == [float("-inf"), None]


def test_a_reply_that_is_not_http_is_an_error_not_a_traceback(monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def answer_garbage():
        for _ in range(4):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"hello, this is not HTTP\r\n\r\n")
            conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    monkeypatch.setattr(remote_module.time, "sleep", lambda s: None)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(
            RewardServerError,
            match=rf"^reward server {url} sent a malformed reply: not HTTP "
            r"\(BadStatusLine: ",
        ):
            rewards.get("remote", url=url, retries=1)(random_images(1), ["a"])
    finally:
        listener.close()


def test_a_burst_of_50_concurrent_clients_is_answered(serve):
    """socketserver's default listen backlog of 5 reset 10-34 of these 50 connections."""

    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    length.kind = "text"
    url = serve(length) + "/score"
    clients = 50
    barrier = threading.Barrier(clients)
    results: list = [None] * clients

    def client(i: int) -> None:
        body = json.dumps({"prompts": ["q"], "completions": ["x" * i]}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        barrier.wait()  # all connect at once
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                results[i] = (response.status, json.loads(response.read())["scores"])
        except OSError as e:
            results[i] = (type(e).__name__, str(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results if r is None or r[0] != 200]
    assert not failed, f"{len(failed)} of {clients} failed, e.g. {failed[:2]}"
    assert [r[1] for r in results] == [[float(i)] for i in range(clients)]  # each its own answer


def test_serve_main_serves_a_plugin_by_keyword_like_trl(tmp_path, monkeypatch):
    (tmp_path / "judge.py").write_text(
        "def words(completions, **kwargs):\n"  # TRL's documented form: no prompts parameter
        "    return [float(len(c.split())) + float(kwargs['bonus'][i]) for i, c in enumerate(completions)]\n"
    )
    monkeypatch.chdir(tmp_path)
    with serving(["judge.py:words", "--kind", "text", "--port", "0", "--quiet"]) as server:
        remote = rewards.get("remote", url=f"http://127.0.0.1:{server.server_address[1]}", kind="text")
        assert remote(["q", "q"], ["one two", "three"], bonus=[10, 20]) == [12.0, 21.0]
        assert remote.health() == {"status": "ok", "reward": "judge.py:words", "kind": "text"}


def test_remote_text_reward_through_the_trl_call_sends_only_data(serve):
    from rewards._common import RewardState, call_text_reward

    seen = {}

    def text(prompts, completions, **columns):
        seen.update(columns)
        return [float(len(c)) for c in completions]

    text.kind = "text"
    remote = rewards.build("remote", {"url": serve(text), "kind": "text"}, "text")
    logs: dict = {}
    out = call_text_reward(
        remote,
        ["q", "r"],
        ["ab", "c"],
        [[1, 2], [3]],
        {"answer": ["1", "2"]},
        state=RewardState(global_step=2),
        logs=logs,
    )
    assert out == [2.0, 1.0]
    assert seen == {"answer": ["1", "2"], "completion_ids": [[1, 2], [3]]}  # no trainer_state, log_metric, log_extra


def _closed_port() -> int:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_remote_reward_failing_in_a_run_is_one_flowrl_error(monkeypatch):
    """Built as a run builds it (`rewards.build`): the server's error is not wrapped into a RewardError with its
    traceback; it is a flowrl error, which the command line prints as one line."""
    from flowrl.errors import FlowrlError

    monkeypatch.setattr(remote_module.time, "sleep", lambda s: None)
    url = f"http://127.0.0.1:{_closed_port()}"
    reward = rewards.build("remote", {"url": url, "retries": 1}, IMAGE)
    with pytest.raises(FlowrlError) as info:
        reward(random_images(1), ["a"])
    assert isinstance(info.value, RewardServerError) and "\n" not in str(info.value)
    assert f"{url} is not answering" in str(info.value)


class HealthPage(BaseHTTPRequestHandler):
    """Something else on the port: answers GET with an HTML page."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _train_with_remote(url: str, tmp_path, *extra) -> list[str]:
    from pathlib import Path

    tiny_cfg = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
    return [
        "train",
        tiny_cfg,
        "model.device=cpu",
        "log.progress=false",
        f"log.run_dir={tmp_path / 'run'}",
        f"rewards=[{{name: remote, kwargs: {{url: '{url}'{''.join(extra)}}}}}]",
    ]


def _one_line(capsys, rc) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_reward_server_that_is_down_is_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    from flowrl.cli import main

    url = f"http://127.0.0.1:{_closed_port()}"
    err = _one_line(capsys, main(_train_with_remote(url, tmp_path)))
    assert f"rewards[0] (remote): reward server {url} is not answering (2 attempts" in err
    assert f"Is the server running? Start it with: flowrl serve-reward NAME --port {url.rsplit(':', 1)[1]}" in err


def test_something_else_on_the_port_or_the_other_kind_is_refused_before_the_model_loads(
    tmp_path, capsys, no_model_load, serve
):
    from flowrl.cli import main

    server = ThreadingHTTPServer(("127.0.0.1", 0), HealthPage)
    server.daemon_threads = True
    with running_servers() as run:
        url = run(server)
        err = _one_line(capsys, main(_train_with_remote(url, tmp_path)))
    assert f"rewards[0] (remote): reward server {url} sent a malformed reply: not JSON" in err
    url = serve(rewards.get("accuracy"), name="accuracy")
    err = _one_line(capsys, main(_train_with_remote(url, tmp_path)))
    assert (
        f"reward server {url} serves a text reward ('accuracy'); this remote reward is of kind 'image' (set its "
        "kind option, or serve an image reward)" in err
    )


def test_preflight_checks_the_servers_of_a_weighted_rewards_remote_components(serve):
    from rewards.remote import check_server, server_urls

    url = serve(MeanPixel(), name="mean_pixel")
    options = {"components": {"near": {"reward": "remote", "url": url}, "jpeg_compressibility": 1.0}}
    assert server_urls("weighted", options) == [(url, IMAGE)]
    assert server_urls("remote", {"url": url, "kind": "text"}) == [(url, "text")]
    assert check_server(url) == {"status": "ok", "reward": "mean_pixel", "kind": "image"}
