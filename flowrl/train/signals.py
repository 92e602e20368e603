"""Stopping on SIGINT / SIGTERM: the first signal stops at the next safe point, a second one at once.

The first signal only sets a flag; the loops ask at their safe points whether any process got one: training at an
epoch's end and before an epoch's update (there `Trainer.stop_if_asked` saves and raises Interrupted; an update runs
to its end, so that the checkpoint is an epoch boundary's and the resumed run trains as the uninterrupted one), and a
rollout or an eval between its batches (`stop_point`: they are abandoned, Abandoned). A second signal raises
StopNow at once (the command line prints one line and exits 128 + signum), losing the work since the last checkpoint;
during a checkpoint write (`deferred`) it waits for the write's end, so no checkpoint is ever left half written.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from flowrl.errors import Interrupted, StopNow


class Abandoned(Exception):
    """A rollout or an eval stopped between its batches because a stop signal arrived: nothing of it is kept."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """The first stop signal received (`signum`, None until one arrives) while `installed()` is active; `on_first`:
    what the announcement of the first says happens."""

    def __init__(self, announce: bool, on_first: str = "stopping at the next safe point and writing a checkpoint"):
        self.signum: int | None = None
        self.announce = announce  # print what happens (the main process)
        self.on_first = on_first
        self.writing = False  # in `deferred()`: a second signal waits for its end
        self.pending: int | None = None  # that second signal

    def _say(self, text: str) -> None:
        if self.announce:
            print(f"\nflowrl: {text}", file=sys.stderr, flush=True)  # (stdout keeps a command's results)

    def _ask(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self._say(
                f"{signal_name(signum)} received: {self.on_first} (a second Ctrl-C or SIGTERM stops at once, "
                "losing the work since the last checkpoint)"
            )
        elif self.writing:
            if self.pending is None:
                self.pending = signum
                self._say(f"second {signal_name(signum)} received: stopping once the checkpoint being written is whole")
        else:
            raise StopNow(f"second {signal_name(signum)} received: stopping now", signum)

    @contextlib.contextmanager
    def deferred(self):
        """A block (a checkpoint write) that a second signal does not cut short: it stops the run at the block's
        end instead. Yields a list: what the block appends to it (what it wrote) ends that StopNow's message."""
        done: list[str] = []
        self.writing = True
        try:
            yield done
        finally:
            self.writing = False
        if self.pending is not None:
            said = "".join(f"; {line}" for line in done)
            raise StopNow(f"second {signal_name(self.pending)} received: stopping now{said}", self.pending)

    def stop_point(self, asked=None) -> None:
        """Between the batches of a rollout or an eval: raise Abandoned when a signal arrived. `asked(flag)`: whether
        any process got one (a collective, e.g. `Strategy.any_process`; default: this process)."""
        flag = self.signum is not None
        if asked(flag) if asked is not None else flag:
            raise Abandoned

    @contextlib.contextmanager
    def installed(self):
        """SIGINT and SIGTERM are this object's inside the block (handlers can only be set from the main thread: in
        another thread nothing is installed); the previous handlers come back after it. Nested in another
        StopSignals' block (the command line's around a run), it starts from that one's record and hands its own
        back, so that a signal before or after this block counts as the first or the second alike."""
        self.pending = None
        if threading.current_thread() is not threading.main_thread():
            self.signum = None
            yield self
            return
        outer = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
        outer = outer if isinstance(outer, StopSignals) else None
        self.signum = outer.signum if outer is not None else None
        previous = {sig: signal.signal(sig, self._ask) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if outer is not None and outer.signum is None:
                outer.signum = self.signum


@contextlib.contextmanager
def eval_signals():
    """`flowrl eval`'s stop signals: the first abandons the eval at its next `stop_point` (Abandoned becomes
    Interrupted, exit 128 + signum: nothing was written), a second stops at once."""
    signals = StopSignals(announce=True, on_first="stopping the eval at its next batch; nothing will be written")
    with signals.installed():
        try:
            yield signals
        except Abandoned:
            raise Interrupted(
                f"interrupted by {signal_name(signals.signum)} during the eval; nothing written", signals.signum
            ) from None
