"""Stopping on SIGINT / SIGTERM at a safe point: the run writes a checkpoint and raises Interrupted.

A signal only sets a flag; the loop asks at its safe points (after a minibatch's optimizer step, before an epoch's
update) whether any process got one, and there `Trainer.stop_if_asked` saves and stops. A second SIGINT stops at
once (KeyboardInterrupt), losing the work since the last checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class StopSignals:
    """The signal received (`signum`, None until one arrives) while `installed()` is active."""

    def __init__(self, announce: bool):
        self.signum: int | None = None
        self.announce = announce  # print what happens (the main process)

    def _ask(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        if self.announce:
            print(
                f"\nflowrl: {signal.Signals(signum).name} received: stopping after the current minibatch and "
                "writing a checkpoint (Ctrl-C again stops at once, losing the work since the last checkpoint)",
                flush=True,
            )

    @contextlib.contextmanager
    def installed(self):
        """SIGINT and SIGTERM set `signum` inside the block (handlers can only be set from the main thread: in another
        thread nothing is installed); the previous handlers come back after it."""
        self.signum = None
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._ask) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
