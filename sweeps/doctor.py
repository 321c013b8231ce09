"""``sweeps doctor SPEC``: what a worker on this machine needs, checked in seconds before it joins.

One :class:`Check` per line: the Optuna storage reachable and writable with these credentials, the
MLflow store (a server reachable, its Host-header check passing, the credentials taken), write
permission on the study's experiment, its artifact store writable, the GPUs the spec or
``--expect-gpus`` asks for visible, and the installed versions those the study recorded. Nothing
here trains, creates a study or a run; the only writes are the probes that prove a write works (a
tag ``sweeps.write_check`` on an existing experiment, a file ``.sweeps-doctor/<host>.txt`` in its
artifact store). A check that cannot run because an earlier one failed says so and is skipped.
"""
from __future__ import annotations

# Each check imports its heavy library (SQLAlchemy, Optuna, MLflow, torch) inside it, lazily for
# start-up: the doctor answers in seconds and a failed check does not pay for the others.
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sweeps.errors import SweepsError, TrackingError
from sweeps.parent_run import package_versions
from sweeps.spec.model import StudySpec
from sweeps.store_urls import redact_url
from sweeps.tracking import layout
from sweeps.tracking.store_checks import (
    apply_fast_fail_http_defaults,
    check_experiment_writable,
    check_sqlite_store,
    check_store,
    host_header_refusal,
    http_credentials,
    is_http_uri,
    sqlite_path,
)

OK, PROBLEM, SKIP = "ok", "PROBLEM", "skip"
# Versions that must match between the process that created the study and a worker: a different
# torch or task code trains differently, a different optuna or mlflow may not read what the other wrote.
COMPARED = ("torch", "torchvision", "optuna", "mlflow", "sweeps", "numpy")


@dataclass(frozen=True)
class Check:
    """One line of the report: ``verdict`` is ok, PROBLEM (exit 2) or skip (not applicable here)."""

    name: str
    verdict: str
    message: str


class _Skip(Exception):
    """Raised by a check that does not apply here, with why."""


def run_checks(spec: StudySpec, expect_gpus: int | None = None) -> Iterator[Check]:
    """Every check, in order; each is run even when an earlier one failed, unless it needs it."""
    uri = spec.tracking_store_uri()
    http = is_http_uri(uri)
    if http:
        apply_fast_fail_http_defaults()
    state: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], str]]] = [
        ("storage", lambda: check_storage(spec)),
        ("mlflow", lambda: check_mlflow_reachable(uri)),
        ("host", lambda: check_host_header(uri, state)),
        ("access", lambda: check_access(uri, state)),
        ("permission", lambda: check_permission(uri, spec.experiment_name(), state)),
        ("artifacts", lambda: check_artifacts(spec, uri, state)),
        ("gpus", lambda: check_gpus(spec, expect_gpus)),
        ("versions", lambda: check_versions(spec, state)),
    ]
    for name, step in steps:
        try:
            yield Check(name, OK, step())
            state[name] = True
        except _Skip as exc:
            yield Check(name, SKIP, str(exc))
        except SweepsError as exc:
            yield Check(name, PROBLEM, str(exc))
        except Exception as exc:  # noqa: BLE001 - a check's failure is a finding, whatever raised it
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            yield Check(name, PROBLEM, f"{type(exc).__name__}: {first}")


# ---- the Optuna storage ------------------------------------------------------------------------
def check_storage(spec: StudySpec) -> str:
    if spec.is_rdb_storage():
        return _check_database(spec.storage_url())
    path = Path(os.path.abspath(spec.storage_url()))
    folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise SweepsError(f"journal {path}: {folder} is not a writable folder; make it writable or set storage")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise SweepsError(f"journal {path} is not readable and writable by this user")
    if spec.tracking_store_uri().startswith(("http://", "https://")):
        return (f"journal {path} writable, but a journal is one machine's storage: workers on other "
                "machines need storage: postgresql://...")
    return f"journal {path} {'exists and is' if path.exists() else 'can be created:'} writable"


def _check_database(url: str) -> str:
    import sqlalchemy

    from sweeps.backends.optuna_storage import sqlalchemy_url

    shown = redact_url(url)
    postgres = url.split(":", 1)[0].split("+", 1)[0] in ("postgresql", "postgres")
    engine = sqlalchemy.create_engine(sqlalchemy_url(url), poolclass=sqlalchemy.pool.NullPool,
                                      connect_args={"connect_timeout": 5} if postgres else {})
    try:
        with engine.connect() as conn:
            if not postgres:
                return f"{shown}: connected"
            has_tables = sqlalchemy.inspect(conn).has_table("trials")
            query = ("SELECT has_table_privilege('trials', 'INSERT') AND has_table_privilege('trials', 'UPDATE') "
                     "AND has_table_privilege('studies', 'INSERT')" if has_tables
                     else "SELECT has_schema_privilege(current_schema(), 'CREATE')")
            user = conn.execute(sqlalchemy.text("SELECT current_user")).scalar()
            if not conn.execute(sqlalchemy.text(query)).scalar():
                what = "insert or update trials" if has_tables else "create Optuna's tables"
                raise SweepsError(f"{shown}: connected as {user!r}, who may not {what}; GRANT it (or use the user "
                                  "that created the study)")
            return f"{shown}: connected as {user!r}, " + ("may write the study's tables" if has_tables
                                                           else "may create Optuna's tables (none yet)")
    except sqlalchemy.exc.OperationalError as exc:
        detail = (str(exc.orig or exc).strip().splitlines() or [""])[0]
        hint = (" (set PGPASSWORD to the user's password)" if "password" in detail
                else "; start the database or fix host, port and database name in storage")
        raise SweepsError(f"{shown}: cannot connect: {detail}{hint}") from None
    finally:
        engine.dispose()


# ---- the MLflow store ------------------------------------------------------------------------
def check_mlflow_reachable(uri: str) -> str:
    import requests

    if not is_http_uri(uri):
        if _no_store_yet(uri):
            check_sqlite_store(uri)  # its folder can be made and written; opening would create the file
            return f"{uri}: no database yet, its folder is writable (the first `sweeps run` creates it)"
        check_store(uri, lambda: _client(uri))  # a local or database store: open it (lock, damage, connect)
        return f"{redact_url(uri)} opens"
    _, _, verify = http_credentials()
    try:
        resp = requests.get(uri.rstrip("/") + "/health", timeout=(3.0, 30.0), verify=verify)
    except requests.exceptions.RequestException as exc:
        raise TrackingError(f"{uri}: no answer ({type(exc).__name__}); start the MLflow server or fix "
                            "tracking.uri, and check a firewall lets this machine reach its port") from None
    if resp.status_code != 200:
        raise TrackingError(f"{uri}/health answered HTTP {resp.status_code}: not an MLflow server, or a proxy "
                            "in front of it refuses")
    return f"{uri} answers /health"


def _needs_server(uri: str, state: dict[str, Any], step: str, why: str) -> None:
    """Skip a server check for a local store, or when the check ``step`` it builds on failed."""
    if not is_http_uri(uri):
        raise _Skip("no server: a local store")
    if step not in state:
        raise _Skip(why)


def check_host_header(uri: str, state: dict[str, Any]) -> str:
    import requests

    _needs_server(uri, state, "mlflow", "the server did not answer")
    headers, auth, verify = http_credentials()
    resp = requests.post(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search", json={"max_results": 1},
                         headers=headers, auth=auth, verify=verify, timeout=(3.0, 90.0))
    refused = host_header_refusal(uri, resp.status_code, resp.text)
    if refused is not None:
        raise refused
    return f"the server takes the Host header of {uri}"


def check_access(uri: str, state: dict[str, Any]) -> str:
    _needs_server(uri, state, "host", "the server did not take the request")
    check_store(uri, lambda: _client(uri))
    _, auth, _ = http_credentials()
    return f"signed in as {auth[0]!r}" if auth else "the server takes this client's requests"


def check_permission(uri: str, experiment: str, state: dict[str, Any]) -> str:
    if not is_http_uri(uri):
        raise _Skip("a local store: the file system's permissions apply (see storage, artifacts)")
    if "access" not in state:
        raise _Skip("the server did not take this client's credentials")
    experiment_id = check_experiment_writable(uri, experiment)
    state["experiment_id"] = experiment_id
    if experiment_id is None:
        return f"experiment {experiment!r} does not exist yet: `sweeps run` creates it (its creator may write it)"
    return f"may create runs in experiment {experiment!r} (id {experiment_id})"


def check_artifacts(spec: StudySpec, uri: str, state: dict[str, Any]) -> str:
    if is_http_uri(uri) and "permission" not in state:
        raise _Skip("no write permission on the experiment was confirmed")
    if "mlflow" not in state:
        raise _Skip("the tracking store did not open")
    path = sqlite_path(uri)
    exp = None if _no_store_yet(uri) else _client(uri).get_experiment_by_name(spec.experiment_name())
    if exp is None:
        if path is not None:  # where tracker_for puts a local store's artifacts
            return _probe_local(path.parent.absolute() / "mlartifacts")
        raise _Skip(f"experiment {spec.experiment_name()!r} does not exist yet: its artifact store is the server's "
                    "default, checked by running doctor again after `sweeps run` created it")
    location = exp.artifact_location
    if location.startswith("file:") or "://" not in location and ":" not in location.split("/", 1)[0]:
        return _probe_local(Path(location.removeprefix("file://").removeprefix("file:")))
    import mlflow
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    mlflow.set_tracking_uri(uri)  # mlflow-artifacts: locations resolve through the tracking server
    with tempfile.TemporaryDirectory(prefix="sweeps-doctor-") as folder:
        probe = Path(folder) / f"{socket.gethostname()}.txt"
        probe.write_text("written by sweeps doctor\n")
        get_artifact_repository(f"{location.rstrip('/')}/.sweeps-doctor").log_artifact(str(probe))
    return f"{location}: wrote .sweeps-doctor/{probe.name}"


def _probe_local(root: Path) -> str:
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise SweepsError(f"artifact folder {root}: {existing} is not a writable folder on this machine (a worker "
                          "writes checkpoints and models there); make it writable or mount it")
    return f"{root} writable"


def _no_store_yet(uri: str) -> bool:
    """A SQLite store whose file does not exist yet: opening it would create it."""
    path = sqlite_path(uri)
    return path is not None and not path.exists()


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


# ---- this machine ------------------------------------------------------------------------------
def check_gpus(spec: StudySpec, expect: int | None) -> str:
    import torch

    count = torch.cuda.device_count()
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) if count else "none"
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{count} visible ({names})" + (f", CUDA_VISIBLE_DEVICES={shown!r}" if shown is not None else "")
    devices = spec.resources.devices
    need = expect if expect is not None else (max(devices) + 1 if isinstance(devices, list) else 0)
    if count < need:
        asked = f"--expect-gpus {expect}" if expect is not None else f"resources.devices {devices}"
        raise SweepsError(f"{asked} needs {need} GPU(s), {seen}: check the job's GPU request (SLURM --gpus-per-task, "
                          "Kubernetes nvidia.com/gpu) and the driver (nvidia-smi)")
    if count == 0:
        return f"{seen}: trials train on CPU" if devices != "cpu" else f"{seen}; the spec asks for CPU"
    return seen


def check_versions(spec: StudySpec, state: dict[str, Any]) -> str:
    if "mlflow" not in state or (is_http_uri(spec.tracking_store_uri()) and "access" not in state):
        raise _Skip("the tracking store did not answer")
    if _no_store_yet(spec.tracking_store_uri()):
        raise _Skip("no tracking store yet, so no study recorded")
    client = _client(spec.tracking_store_uri())
    exp = client.get_experiment_by_name(spec.experiment_name())
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], f"tags.`{layout.TAG_ROLE}` = '{layout.ROLE_STUDY}'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise _Skip(f"no study recorded in experiment {spec.experiment_name()!r} yet")
    recorded = {k.removeprefix("version."): v for k, v in runs[0].data.params.items() if k.startswith("version.")}
    here = package_versions(COMPARED)
    differ = [f"{name} {here[name]} here, {recorded[name]} in the study" for name in COMPARED
              if name in recorded and recorded[name] != here[name]]
    if differ:
        raise SweepsError(f"study run {runs[0].info.run_id}: " + "; ".join(differ)
                          + ": install the study's versions (docker/constraints.txt pins the image's)")
    return f"{', '.join(f'{n} {here[n]}' for n in COMPARED if n in recorded)} as the study recorded"
