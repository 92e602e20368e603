"""rollout.async: the next epoch's rollout sampled in a worker process while the trainer updates on this one.

The worker (torch.multiprocessing, spawn) builds the run's policy and objective from the config, as the trainer
does, with torch threads of its own (rollout.async_threads). It answers two messages, in order:

    ("weights", version, tensors)   the trained adapter (and the objective's state, e.g. NFT's "old" adapter that
                                    samples) after `version` epochs: loaded before the next rollout
    ("rollout", epoch, request)     the epoch's prompts and generator seed: sampled with the newest weights it has;
                                    the batch goes back with the version it was sampled with

The trainer sends the weights of the epochs done and asks for the first epoch (version lag 0), then, as soon as it
takes epoch k's batch, asks for epoch k+1 (sampled with the weights before epoch k's update: lag 1) and sends the
weights after the update. The batch's tensors travel in shared memory (the queue's). An error in the worker comes
back as its one line; a worker that dies is noticed by its exit code: either is a RolloutWorkerError, raised before
the epoch changes anything.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import time
import traceback

import torch
import torch.multiprocessing as mp

from flowrl.errors import FlowrlError

#: seconds between two looks at the worker's liveness while waiting for its batch
POLL_SECONDS = 1.0


class RolloutWorkerError(FlowrlError):
    """The rollout worker (rollout.async) failed or died."""


def worker_main(cfg, device: str, threads: int, commands, results) -> None:
    """The worker process: build the policy and objective, then load weights and roll out as the messages say."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which stops this process
    torch.set_num_threads(threads)
    try:
        from flowrl.objectives import build_objective
        from flowrl.policies import build_policy
        from flowrl.seeding import seed_everything

        seed_everything(cfg.train.seed)  # as the trainer builds them (the weights are then loaded)
        policy = build_policy(cfg, torch.device(device))
        objective = build_objective(cfg, policy, 1)
        params = dict(policy.named_trainable_parameters())
        version, idle = None, 0.0
        results.put(("ready", None, torch.get_num_threads()))
        while True:
            t0 = time.perf_counter()
            kind, number, payload = commands.get()
            idle += time.perf_counter() - t0
            if kind == "stop":
                return
            if kind == "weights":
                trainable, state = payload
                with torch.no_grad():
                    for name, value in trainable.items():
                        params[name].copy_(value)
                objective.load_state_dict(state)
                version = number
                continue
            t1 = time.perf_counter()
            batch = run_rollout(objective, number, payload)
            results.put(("batch", number, (version, batch, idle, time.perf_counter() - t1)))
            idle = 0.0
    except BaseException as e:  # its one line goes back; the trainer raises it
        line = traceback.format_exception_only(type(e), e)[-1].strip()
        with contextlib.suppress(Exception):
            results.put(("error", None, line))
            results.close()
            results.join_thread()
        raise SystemExit(1) from None


def run_rollout(objective, epoch: int, request: dict):
    """Epoch `epoch`'s rollout of `request` (its prompts, metadata and generator seed), as `Trainer.rollout` samples
    it."""
    gen = torch.Generator().manual_seed(request["seed"])
    return objective.rollout(request["prompts"], request["metadata"], epoch=epoch, generator=gen)


class AsyncRollout:
    """The trainer's side: the worker process, the weights it is sent, and the batches it sends back."""

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device = cfg, str(device)
        self.target = worker_main  # (tests swap in a worker that fails)
        self.process = None
        self.threads: int | None = None  # the worker's torch threads, once it is ready
        self.asked: int | None = None  # the epoch whose rollout the worker was asked for and has not returned
        self.sent: dict[int, tuple[dict, dict]] = {}  # the last two versions sent (trainable, objective state)

    def start(self) -> None:
        """Start the worker and wait until it is ready (`spawn`, then `ready`)."""
        self.spawn()
        self.ready()

    def spawn(self) -> None:
        """Start the worker's process; it builds its policy while this one goes on (`ready` waits for it)."""
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        threads = self.cfg.rollout.async_threads
        self.process = ctx.Process(
            target=self.target,
            args=(self.cfg, self.device, threads, self.commands, self.results),
            name="flowrl-rollout-worker",
            daemon=True,
        )
        self.process.start()
        self.threads = None

    def ready(self) -> None:
        """Wait until the spawned worker has built its policy (at once when it had)."""
        if self.threads is None:
            self.threads = self._receive("ready", "starting")

    def send_weights(self, version: int, trainable: dict, state: dict) -> None:
        """The trained tensors after `version` epochs (copied: the trainer goes on changing its own)."""
        copy = {n: p.detach().to("cpu", copy=True) for n, p in trainable.items()}
        state = {n: v.detach().to("cpu", copy=True) for n, v in state.items()}
        self.commands.put(("weights", version, (copy, state)))
        self.sent = {v: w for v, w in self.sent.items() if v >= version - 1} | {version: (copy, state)}

    def ask(self, epoch: int, request: dict) -> None:
        self.commands.put(("rollout", epoch, request))
        self.asked = epoch

    def sampling_weights(self) -> tuple[int, dict, dict] | None:
        """(version, trainable, objective state) of the version before the newest sent: the one the next epoch samples
        with (epoch e samples with version e - 1), which a checkpoint keeps so that a resumed run samples that epoch
        as an uninterrupted one does; None before two versions were sent."""
        newest = max(self.sent, default=None)
        if newest is None or newest - 1 not in self.sent:
            return None
        return (newest - 1, *self.sent[newest - 1])

    def take(self, epoch: int, waiting=None):
        """Epoch `epoch`'s batch: (batch, the version it was sampled with, the worker's idle seconds before it, its
        rollout's seconds). `waiting()` is called while it waits (a stop signal's safe point)."""
        assert self.asked == epoch, (self.asked, epoch)
        version, batch, idle, seconds = self._receive("batch", f"epoch {epoch + 1}'s rollout", waiting)
        self.asked = None
        return batch, version, idle, seconds

    def _died(self, what: str) -> RolloutWorkerError:
        return RolloutWorkerError(
            f"the rollout worker (rollout.async, pid {self.process.pid}) died during {what} with exit code "
            f"{self.process.exitcode}; resume with checkpoint.resume=auto (or set rollout.async=false)"
        )

    def _receive(self, kind: str, what: str, waiting=None):
        while True:
            try:
                got, _, payload = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if waiting is not None:
                    waiting()
                if not self.process.is_alive():
                    raise self._died(what) from None
                continue
            except (OSError, EOFError):
                # a batch the worker put just before it died: its tensors travel as file descriptors that the dead
                # worker can no longer hand over (ConnectionRefusedError); the batch is lost with the worker
                self.process.join(timeout=10)
                if self.process.is_alive():
                    raise
                raise self._died(what) from None
            if got == "error":
                raise RolloutWorkerError(
                    f"the rollout worker (rollout.async) failed during {what}: {payload}; resume with "
                    "checkpoint.resume=auto (or set rollout.async=false)"
                )
            return payload

    def close(self) -> None:
        """Stop and join the worker (at once when it is sampling: its batch is not needed)."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.is_alive() and self.asked is None:
            with contextlib.suppress(Exception):
                self.commands.put(("stop", None, None))
            proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        for q in (self.commands, self.results):
            q.cancel_join_thread()
            q.close()
        self.asked = None
