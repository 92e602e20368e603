"""One run at a time in a run directory: a lock file `flowrl.lock` (process id, host, start time) held for the life
of a run.

It is created atomically (O_EXCL) before the model loads and removed when the run ends, also on an error or a stop
signal. A second run into the folder refuses in one line naming the holder. A lock whose process is gone (same host,
the pid dead or now another process) is taken over with a warning; a lock of another host cannot be checked from
here, so it refuses and says how to remove it. `flowrl eval` and `flowrl sample` only read checkpoints: they take no
lock. The lock is not a run's file (`rundir.run_files`): log.overwrite=true leaves it alone.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
import uuid
import warnings
from pathlib import Path

from flowrl.errors import RunDirError

LOCK_NAME = "flowrl.lock"


def _process_identity(pid: int) -> str | None:
    """The boot and start time of process `pid` (Linux: /proc), which a later process with the same pid does not
    share; None where it cannot be read."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22: starttime, after the (comm) field
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process that wrote lock `holder` (on this host) still runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    recorded, now = holder.get("process"), _process_identity(pid)
    return not (recorded and now and now != recorded)  # else the pid was reused by another process


def _read(path: Path) -> dict | None:
    """The lock's content; None while it is being written (or when it is not a lock's JSON)."""
    for _ in range(20):  # a lock just created (O_EXCL) is empty until its writer writes it
        try:
            holder = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(holder, dict):
                return holder
        except FileNotFoundError:
            raise
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    return None


class RunLock:
    """The lock of `run_dir`: `acquire()` takes it (or raises RunDirError), `release()` removes it; both may be
    called again. A lock still held when the interpreter exits is released then."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.held = False
        self.info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "process": _process_identity(os.getpid()),
            "token": uuid.uuid4().hex,
        }

    def acquire(self) -> RunLock:
        if self.held:
            return self
        for _ in range(3):  # a lock removed between our attempt and our read: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    self._take_over(_read(self.path))
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(self.info) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)
            return self
        raise RunDirError(f"log.run_dir={str(self.run_dir)!r}: could not take its lock {self.path}; try again")

    def _take_over(self, holder: dict | None) -> None:
        """Remove the lock `holder` when its run is gone (warning), else raise the one-line refusal."""
        where = f"log.run_dir={str(self.run_dir)!r}"
        if holder is None:
            raise RunDirError(
                f"{where} holds a lock file that is not flowrl's or is unreadable ({self.path}); if no run "
                "uses the folder, delete that file, or pick another log.run_dir"
            )
        pid, host, since = holder.get("pid"), holder.get("host"), holder.get("started", "an unknown time")
        if host != self.info["host"]:
            raise RunDirError(
                f"{where} is locked by a run on host {host} (pid {pid}, since {since}), which cannot be checked "
                f"from here; pick another log.run_dir, or wait for it to end (if you are sure it is gone, delete "
                f"{self.path})"
            )
        if pid != self.info["pid"] and _alive(holder):
            raise RunDirError(
                f"{where} is in use by another run (pid {pid} on {host}, since {since}); pick another "
                "log.run_dir, or wait for that run to end"
            )
        if pid != self.info["pid"]:  # (our own pid: an earlier run of this process that never ended, e.g. a Trainer)
            warnings.warn(
                f"{where}: taking over the lock of a run that is gone (pid {pid} on this host, since {since})",
                stacklevel=4,
            )
        self.path.unlink()

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if not self.held:
            return
        self.held = False
        atexit.unregister(self.release)
        try:
            if json.loads(self.path.read_text(encoding="utf-8")).get("token") == self.info["token"]:
                self.path.unlink()
        except (OSError, ValueError, AttributeError):
            pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
