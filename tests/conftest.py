"""Suite-wide settings: offline, one thread for tiny models, and no network beyond loopback."""

import ipaddress
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models: 1 thread (a second OpenMP thread makes tiny ops up to 100x slower under load).
torch.set_num_threads(1)


def _is_loopback(address) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _guarded(real):
    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
            raise ConnectionRefusedError(f"tests may not open non-loopback sockets (tried {address!r})")
        return real(self, address)

    return connect


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Fail any test that connects to a non-loopback address."""
    monkeypatch.setattr(socket.socket, "connect", _guarded(_real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", _guarded(_real_connect_ex))


def pytest_report_header(config):
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']}"
