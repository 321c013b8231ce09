"""One error hierarchy. Every message names the value, the place and the fix.

The CLI maps SweepsError subclasses to exit codes: bad input (spec, path, CLI use) -> 2.
"""
from __future__ import annotations

from collections.abc import Iterator


def cause_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then its causes and contexts, each once: a library's error (Optuna's, MLflow's)
    often wraps the database's own, which says what went wrong."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


class SweepsError(Exception):
    exit_code = 1


class SpecError(SweepsError):
    """A study spec is invalid. ``problems`` holds every problem found, one line each."""

    exit_code = 2

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = str(path)
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{self.path}: {n} problem{'s' if n != 1 else ''} in the study spec:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class UnsafeNameError(SweepsError):
    """A name that reaches the file system or the artifact store would escape its folder."""

    exit_code = 2


class PathError(SweepsError):
    """A file or folder a command needs cannot be used as it is: a file where a folder must be,
    a folder where a file must be, no permission, or damaged. The message names it and the fix."""

    exit_code = 2


class BackendError(SweepsError):
    """The study backend (Optuna storage, Ray) failed or refused."""


class TrackingError(SweepsError):
    """The MLflow tracking store cannot be reached or refused a write."""


class StoreGone(SweepsError):
    """A store (the Optuna storage, the MLflow tracking store) has not answered for longer than the
    wait allows (``SWEEPS_STORAGE_WAIT_S``): the process stops as SIGTERM stops it (running trials
    checkpoint and are requeued) and exits as SIGTERM does, 128 + 15."""

    exit_code = 143


class UsageError(SweepsError):
    """Command-line arguments that do not fit together; the message says which to give."""

    exit_code = 2


class UnknownBackendError(SweepsError, ValueError):
    """A backend name that is neither optuna nor ray. A ValueError too, as it was before it
    joined this hierarchy, for callers that catch that."""

    exit_code = 2


class ResourcesError(SweepsError, ValueError):
    """``resources:`` asks for something this machine cannot give. A ValueError too, so
    callers validating plain values can catch it without knowing the sweeps hierarchy."""

    exit_code = 2


class RunLookupError(SweepsError):
    """A run id, trial or tracking store named on the command line does not exist."""

    exit_code = 2


class RerunError(SweepsError):
    """A run cannot be rebuilt (no resolved config, a config this code cannot read)."""


class PromoteError(SweepsError):
    """Nothing can be promoted (no usable trial, a model that fails its checks)."""


class ArtifactError(PromoteError):
    """A trial's artifact that promote must load (its ONNX or TorchScript file) is not a model the
    loader can read, or not one that takes the trial's inputs: corrupt, truncated or crafted. Bad
    input, so exit 2; the message names the run, the artifact and the fix."""

    exit_code = 2


class NothingQualifies(PromoteError):
    """``sweeps promote --where``: no trial of the front meets the conditions (a usage matter: exit 2)."""

    exit_code = 2


class BadNameError(SweepsError):
    """A model name or alias the registry would refuse."""

    exit_code = 2


class PromoteRefused(SweepsError):
    """The candidate is worse than the alias holder and ``--force`` was not given."""


class StudyStateError(SweepsError):
    """The study on storage does not match what was asked (changed search space, missing study)."""

    exit_code = 2


class DiskFullError(SweepsError):
    """A write failed for lack of space; the message names the path and its free space. Like
    a read-only folder, the environment needs a fix before a rerun (which resumes)."""

    exit_code = 2


class TrackingDiskFullError(TrackingError, DiskFullError):
    """The MLflow store (or the local spool) cannot write for lack of space: a TrackingError to
    the code that handles those, a DiskFullError (exit 2, path and free space) to the user."""


class TrackingPathError(TrackingError, PathError):
    """The MLflow store's local file cannot be used (a file where its folder must be, damaged):
    a TrackingError to the code that handles those, a PathError (exit 2) to the user."""


class StoppedBySignal(SweepsError):
    """SIGINT or SIGTERM ended a wait that had nothing to save (sweeps/stop_signals.py); the exit
    code is 128 + the signal's number, as for a study stopped by it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
