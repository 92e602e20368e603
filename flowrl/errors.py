"""Errors a user can fix. The command line prints their one-line message (no traceback) and exits non-zero;
`FLOWRL_DEBUG=1` shows the traceback too."""

from __future__ import annotations


class FlowrlError(Exception):
    """A mistake in the input (config, files, checkpoint, data) or a run that had to stop: the message says what was
    wrong and what would be right."""

    exit_code = 1


class ConfigError(FlowrlError, ValueError):
    """A config key or value that is not valid; the message says what would be."""

    exit_code = 2


class ConfigWarning(UserWarning):
    """A config that works but should change (an old spelling of a key)."""


class CheckpointError(FlowrlError, ValueError):
    """A checkpoint directory that is missing, incomplete or corrupt (the message names the file)."""


class CheckpointConfigError(CheckpointError):
    """A config that does not fit the checkpoint it resumes or evaluates (another model, adapter, batch shape or
    objective): a config error, so the command line exits with 2."""

    exit_code = 2


class DataError(FlowrlError, ValueError):
    """Training data that the loaded model cannot take (e.g. latents of another shape); the message names the file
    and row."""


class RunDirError(FlowrlError):
    """A run directory that holds another run, or cannot be written."""


class EngineError(FlowrlError):
    """A rollout engine's server that cannot be reached, answers with an error or is of the wrong kind (the message
    names its URL and how to start it)."""


class NonFiniteError(FlowrlError, FloatingPointError):
    """NaN or inf where a number must be finite: weights about to be checkpointed, or a run of bad steps."""


class Interrupted(FlowrlError):
    """SIGINT / SIGTERM: the run wrote a checkpoint and stopped; the message says how to resume."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopNow(BaseException):
    """A second SIGINT / SIGTERM: stop at once. A BaseException, like KeyboardInterrupt, so that no `except Exception`
    on its way swallows it; the command line prints its one line and exits 128 + signum."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
