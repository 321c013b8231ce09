"""Write tiny study specs and run the real `sweeps` CLI on them: in a subprocess (:func:`run_cli`),
or in this process (:func:`cli_in_process`) where the process boundary is not what a test checks."""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


_TEMPLATE_DB: Path | None = None


def empty_mlflow_db() -> Path:
    """An MLflow SQLite store with its tables already created, made once per test session.
    Creating the tables (alembic migrations) costs seconds on every fresh store."""
    global _TEMPLATE_DB
    if _TEMPLATE_DB is None or not _TEMPLATE_DB.exists():
        import tempfile

        from mlflow.tracking import MlflowClient

        folder = Path(tempfile.mkdtemp(prefix="sweeps-mlflow-template-"))
        MlflowClient(f"sqlite:///{folder}/mlflow.db").search_experiments()
        _TEMPLATE_DB = folder / "mlflow.db"
    return _TEMPLATE_DB


def migrated_store(folder: Path, name: str = "mlflow.db") -> str:
    """The URI of a real, empty MLflow SQLite store at ``folder/name``, copied from
    :func:`empty_mlflow_db` (a store MLflow creates itself migrates its tables for seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(empty_mlflow_db(), folder / name)
    return f"sqlite:///{folder / name}"


# The tiny digits-MLP study every CLI-level test (and benchmarks/common.tiny_spec) starts from.
TINY_STUDY: dict = {
    "name": "tiny",
    "description": "tiny test study",
    "task": {"name": "digits", "model": "mlp", "args": {"width": 32}},
    "train": {"epochs": 2, "batch_size": 128, "optimizer": "sgd", "scheduler": "constant",
              "num_workers": 0, "export_onnx": False, "seed": 0},
    "search": {"lr": {"type": "float", "low": 0.01, "high": 0.5, "log": True}},
    "objective": {"metric": "val_acc", "direction": "maximize"},
    "sampler": {"name": "random", "seed": 0},
    "pruner": {"name": "none"},
    "budget": {"n_trials": 4, "max_failures": 3},
    "resources": {"devices": "cpu", "workers": 1},
    "tracking": {"uri": "sqlite:///runs/mlflow.db"},
}


def with_overrides(spec: dict, **overrides) -> dict:
    """A copy of ``spec`` where a section given as a dict is merged into the section it
    names, except ``search``, which it replaces (a new search space); other values replace."""
    out = copy.deepcopy(spec)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "search":
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def tiny_spec(name: str = "tiny", **overrides) -> dict:
    """The tiny study (about a second of training per trial) named ``name``, with ``overrides``."""
    return with_overrides(TINY_STUDY, name=name, **overrides)


def save_spec(folder: Path, spec: dict, seed_store: bool = True) -> Path:
    """Write ``spec`` to ``folder/<name>.yaml``. ``seed_store`` copies an empty,
    already-migrated MLflow store to ``runs/mlflow.db`` when the spec uses that store (only
    saves time; tests that check that nothing is created, and benchmarks, pass False)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    db = folder / "runs" / "mlflow.db"
    if seed_store and spec.get("tracking", {}).get("uri") == "sqlite:///runs/mlflow.db" and not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(empty_mlflow_db(), db)
    return path


def write_spec(folder: Path, name: str = "tiny", seed_store: bool = True, **overrides) -> Path:
    """Write the tiny study with ``overrides`` (see :func:`tiny_spec`) to ``folder``."""
    return save_spec(folder, tiny_spec(name, **overrides), seed_store)


def sweeps_env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    env.pop("MLFLOW_TRACKING_URI", None)  # the spec's store, not the caller's
    env.pop("RAY_ADDRESS", None)  # nor the caller's Ray cluster
    return env


def run_cli(cwd: Path, *args: str, timeout: float = 900, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sweeps.cli", *args], cwd=cwd, env=sweeps_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def cli_in_process(cwd: Path, *args: str, **env) -> subprocess.CompletedProcess:
    """``sweeps ARGS`` through :func:`sweeps.cli.main` in this process, in ``cwd``, with the
    environment :func:`run_cli` gives its subprocess: the same exit code and the same text on
    stdout and stderr, without a process that imports the whole stack again. What the command
    prints (its consoles write to ``sys.stdout`` and ``sys.stderr``), its warnings (the handler
    ``sweeps.cli.main`` configures in a process of its own) and what the processes it starts print
    (a study's workers, which inherit file descriptors 1 and 2) are all captured. The working
    directory, the environment and the descriptors are restored afterwards."""
    from sweeps import cli

    before_cwd, before_env, environment = os.getcwd(), dict(os.environ), sweeps_env(**env)
    out, err = io.StringIO(), io.StringIO()
    warnings = logging.StreamHandler(err)
    warnings.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    warnings.setLevel(logging.WARNING)
    root = logging.getLogger()
    with tempfile.TemporaryFile() as fd_out, tempfile.TemporaryFile() as fd_err:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(fd_out.fileno(), 1)
        os.dup2(fd_err.fileno(), 2)
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(cwd)
        root.addHandler(warnings)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = cli.main(list(args))
                except SystemExit as exc:  # argparse's usage errors and --help
                    code = exc.code if isinstance(exc.code, int) else 1
        finally:
            root.removeHandler(warnings)
            os.chdir(before_cwd)
            os.environ.clear()
            os.environ.update(before_env)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        texts = []
        for captured, fd_file in ((out, fd_out), (err, fd_err)):
            fd_file.seek(0)
            texts.append(captured.getvalue() + fd_file.read().decode(errors="replace"))
    return subprocess.CompletedProcess(["sweeps", *args], int(code or 0), *texts)


def start_cli(cwd: Path, *args: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sweeps.cli", *args], cwd=cwd, env=sweeps_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def mlflow_runs(cwd: Path, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd}/runs/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000) if exp else []


def load_study(cwd: Path, name: str):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(cwd / "runs" / f"{name}.journal")))
    return optuna.load_study(study_name=name, storage=storage)


def sqlite_rdb_spec(folder: Path, name: str, storage_query: str = ""):
    """A digits study on SQLite RDB storage (heartbeats, as on PostgreSQL) with its MLflow store
    in ``folder``: for tests of the heartbeat machinery without a server."""
    from sweeps.spec.load import spec_from_dict

    return spec_from_dict({"name": name, "task": {"name": "digits", "model": "mlp"},
                           "search": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
                           "tracking": {"uri": f"sqlite:///{folder}/mlflow.db"},
                           "storage": f"sqlite:///{folder}/optuna.db{storage_query}"})


def silence_heartbeat(study, trial_id: int, seconds: int = 60) -> None:
    """Move trial ``trial_id``'s last heartbeat ``seconds`` back in the study's RDB storage: its
    worker as if silent that long, without waiting for the database's clock (SQLite's ``now()``
    has whole seconds)."""
    import sqlalchemy

    from sweeps.backends import optuna_adapter

    rdb = optuna_adapter.rdb_of(optuna_adapter.storage_of(study))
    assert rdb is not None, "heartbeats live in an RDB storage"
    earlier = {"sqlite": f"datetime(heartbeat, '-{seconds} seconds')",
               "postgresql": f"heartbeat - interval '{seconds} seconds'"}[rdb.engine.dialect.name]
    with rdb.engine.begin() as conn:
        moved = conn.execute(sqlalchemy.text(f"UPDATE trial_heartbeats SET heartbeat = {earlier} WHERE trial_id = :t"),
                             {"t": trial_id})
    assert moved.rowcount == 1, f"trial {trial_id} has no heartbeat to move"


def silence_worker(study, worker: str) -> None:
    """:func:`silence_heartbeat` for each RUNNING trial that ``worker`` (its ``worker`` user
    attribute) holds: a killed worker's trials then look as stale as they will be once the grace
    period has passed, and a timer fails them at its next look. A worker with no trial at all is
    an error (a wrong name would silence nothing, and the test would wait the grace out)."""
    from sweeps.backends import optuna_adapter

    trials = [t for t in study.trials if t.user_attrs.get("worker") == worker]
    assert trials, f"no trial of the study names worker {worker!r}"
    for trial in trials:
        if trial.state.name == "RUNNING":
            silence_heartbeat(study, optuna_adapter.trial_id_of(trial))
