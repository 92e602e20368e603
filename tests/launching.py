"""`accelerate launch` for the multi-process tests, each on a port of its own."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

ACCELERATE = Path(sys.executable).parent / "accelerate"


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch() -> list[str]:
    """The start of an `accelerate launch` command with a free main-process port: a busy default port (29500,
    taken by another run on the machine) sends accelerate into a fallback launch mode whose processes can abort
    at exit."""
    return [str(ACCELERATE), "launch", "--main_process_port", str(free_port())]


def flowrl_train_on_two_cpu_processes(*args: str) -> list[str]:
    """`accelerate launch` of `flowrl train ARGS` on 2 CPU processes (gloo), with the shipped cpu_2proc.yaml."""
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "cpu_2proc.yaml"
    return [*accelerate_launch(), "--config_file", str(config), "-m", "flowrl", "train", *args]
