"""The suite's own guards and the toy demo."""

import socket

import pytest

from flowrl.worlds.toy import run_toy_grpo


def test_network_guard_blocks_non_loopback():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(ConnectionRefusedError, match="non-loopback"):
            s.connect(("192.0.2.1", 80))  # TEST-NET-1: never routed
    finally:
        s.close()


def test_network_guard_allows_loopback():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        client.connect(server.getsockname())
    finally:
        client.close()
        server.close()


def test_toy_grpo_raises_reward():
    history = run_toy_grpo(steps=25, seed=1, print_fn=None)
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert first < 0.3  # random strings over 26 letters match ~1/26 of positions
    assert last > first + 0.4
