"""Run by tests/test_trainer_image.py under `accelerate launch --num_processes 2`: `flowrl train` with the
overrides given, on a process CPU clock that runs 3 times too fast on rank 1, so the two processes measure
different shares of a time budget (as processes of unequal load do)."""

import os
import sys
import time

if os.environ.get("RANK") == "1":
    process_time = time.process_time
    time.process_time = lambda: 3.0 * process_time()

from flowrl.cli import main  # noqa: E402

sys.exit(main(["train", *sys.argv[1:]]))
