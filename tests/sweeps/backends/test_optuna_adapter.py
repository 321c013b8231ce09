"""sweeps/backends/optuna_adapter.py, the one module allowed to use Optuna's private API: it was
checked against the installed Optuna, each of its functions does what it says on real
storages, and no other module of sweeps/ or dashboards/ reaches into Optuna's privates."""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.storages import InMemoryStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
from optuna.trial import TrialState

from sweeps.backends import optuna_adapter as adapter
from tests.sweeps.study_helpers import silence_heartbeat

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("sweeps", "dashboards")
ADAPTER = ROOT / "sweeps" / "backends" / "optuna_adapter.py"
LR = {"lr": FloatDistribution(0.01, 0.1)}
# Heartbeats are experimental in Optuna and warn when used outside Study.optimize, as sweeps does.
pytestmark = [pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
              pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")]


def test_optuna_is_the_version_the_adapter_was_checked_against():
    assert optuna.__version__ == adapter.OPTUNA_CHECKED, (
        f"Optuna is {optuna.__version__}, but sweeps/backends/optuna_adapter.py was checked against "
        f"{adapter.OPTUNA_CHECKED}. Private names change without notice: re-check each function of the "
        "adapter against this Optuna's source (run this file's tests too), then set OPTUNA_CHECKED.")


# ---- each function, on real storages -----------------------------------------------------------
def _journal(path: Path) -> JournalStorage:
    return JournalStorage(JournalFileBackend(str(path)))


def _rdb(tmp_path: Path, **heartbeat) -> RDBStorage:
    return RDBStorage(f"sqlite:///{tmp_path}/optuna.db", **heartbeat)


@pytest.mark.parametrize("kind", ["memory", "journal"])
def test_storage_of_is_the_storage_the_study_was_made_with(tmp_path, kind):
    storage = InMemoryStorage() if kind == "memory" else _journal(tmp_path / "j.log")
    study = optuna.create_study(storage=storage)
    assert adapter.storage_of(study) is storage


def test_storage_of_an_rdb_study_is_optunas_cache_in_front_of_it(tmp_path):
    storage = _rdb(tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    cached = adapter.storage_of(study)
    assert cached is not storage  # create_study wraps RDBStorage; writes through it still land in the database
    cached.set_study_user_attr(cached.get_study_id_from_name("s"), "k", 1)
    assert storage.get_study_user_attrs(storage.get_study_id_from_name("s")) == {"k": 1}


def test_trial_id_of_is_the_storage_id_of_a_trial_and_of_its_frozen_copy(tmp_path):
    storage = _journal(tmp_path / "j.log")
    first = optuna.create_study(storage=storage, study_name="first")
    first.ask(LR)
    first.ask(LR)
    study = optuna.create_study(storage=storage, study_name="second")
    trial = study.ask(LR)  # number 0 of its study; the journal numbers trial ids across studies
    [frozen] = study.get_trials(deepcopy=False)
    expected = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name("second"), 0)
    assert adapter.trial_id_of(trial) == adapter.trial_id_of(frozen) == expected == 2


def test_stored_trial_sees_what_another_process_wrote(tmp_path):
    path = tmp_path / "j.log"
    study = optuna.create_study(storage=_journal(path), study_name="s")
    trial = study.ask(LR)
    [snapshot] = study.get_trials(deepcopy=True)
    other = optuna.load_study(study_name="s", storage=_journal(path))  # as another process opens it
    other_storage = adapter.storage_of(other)
    other_storage.set_trial_state_values(adapter.trial_id_of(snapshot), TrialState.FAIL)
    assert snapshot.state == TrialState.RUNNING
    assert adapter.stored_trial(study, trial).state == adapter.stored_trial(study, snapshot).state == TrialState.FAIL


def test_heartbeat_enabled_only_on_rdb_storage_opened_with_an_interval(tmp_path):
    assert not adapter.heartbeat_enabled(optuna.create_study())
    assert not adapter.heartbeat_enabled(optuna.create_study(storage=_journal(tmp_path / "j.log")))
    assert not adapter.heartbeat_enabled(optuna.create_study(storage=_rdb(tmp_path)))
    assert adapter.heartbeat_enabled(optuna.create_study(storage=_rdb(tmp_path, heartbeat_interval=5)))


@pytest.mark.parametrize("grace, expected", [(7, 7), (None, 6)])  # none given: twice the interval
def test_heartbeat_grace_seconds_reads_the_wrapped_rdb_storage(tmp_path, grace, expected):
    study = optuna.create_study(storage=_rdb(tmp_path, heartbeat_interval=3, grace_period=grace))
    assert adapter.heartbeat_grace_seconds(study) == expected


def test_stale_trial_ids_are_the_running_trials_silent_past_the_grace_period(tmp_path):
    study = optuna.create_study(storage=_rdb(tmp_path, heartbeat_interval=1, grace_period=1), study_name="s")
    silent, done = study.ask(LR), study.ask(LR)
    storage = adapter.storage_of(study)
    for trial in (silent, done):
        storage.record_heartbeat(adapter.trial_id_of(trial))
    study.tell(done, 0.5)
    assert adapter.stale_trial_ids(study) == []  # within the grace period
    for trial in (silent, done):
        silence_heartbeat(study, adapter.trial_id_of(trial))
    assert adapter.stale_trial_ids(study) == [adapter.trial_id_of(silent)]  # finished trials are not stale
    assert adapter.stored_trial(study, silent).state == TrialState.RUNNING  # listed, not failed


def test_journal_lock_suffix_is_the_link_optunas_own_journal_lock_makes(tmp_path):
    journal = tmp_path / "j.log"
    journal.touch()
    lock = JournalFileSymlinkLock(str(journal))
    assert lock.acquire()
    try:
        assert Path(f"{journal}{adapter.JOURNAL_LOCK_SUFFIX}").is_symlink()
    finally:
        lock.release()


# ---- no other module uses Optuna's private API -------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_defined(tree: ast.AST) -> set[str]:
    """Private names a piece of source defines: functions, classes, attributes, variables."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if _private(n)}


@functools.cache
def _optuna_private_names() -> frozenset[str]:
    """Every private name the installed Optuna defines (optuna.testing aside: its helpers are no
    objects sweeps gets), private modules and packages included."""
    package = Path(optuna.__file__).parent
    names: set[str] = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[0] == "testing":
            continue
        names |= {p for p in parts if _private(p)}
        names |= _private_names_defined(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


def _optuna_bound_names(tree: ast.AST) -> set[str]:
    """Names a module binds by importing from Optuna (``optuna``, ``BaseSampler``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "optuna"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "optuna":
            names |= {a.asname or a.name for a in node.names}
    return names


def _optuna_bases_private_names(module_name: str, class_name: str) -> set[str]:
    """Private names of the Optuna classes a class of ours derives from (its own are free).
    The module is imported to follow the class's bases through Optuna's hierarchy."""
    cls = getattr(importlib.import_module(module_name), class_name, None)
    names: set[str] = set()
    for base in inspect.getmro(cls)[1:] if inspect.isclass(cls) else ():
        if base.__module__.split(".")[0] == "optuna":
            names |= _private_names_defined(ast.parse(inspect.getsource(base)))
    return names


def _receiver_is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private_optuna_uses(path: Path, optuna_names: frozenset[str], root: Path = ROOT) -> list[str]:
    """``file:line: what`` for each use of Optuna's private API in the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_name = ".".join(path.relative_to(root).with_suffix("").parts)
    from_optuna = _optuna_bound_names(tree)
    found = []

    def say(node: ast.AST, what: str) -> None:
        found.append(f"{path.relative_to(root)}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "optuna" and any(map(_private, alias.name.split("."))):
                    say(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "optuna":
            private = [a.name for a in node.names if _private(a.name)]
            if any(map(_private, node.module.split("."))) or private:
                say(node, f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in optuna_names:
            if not _receiver_is_self(node.value):
                say(node, ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value in optuna_names
              and not _receiver_is_self(node.args[0])):
            say(node, ast.unparse(node))
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                        "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.split(".")[0] == "optuna" and any(map(_private, node.args[0].value.split(".")))):
            say(node, ast.unparse(node))
        elif isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[0] in from_optuna for b in node.bases):
            inherited = _optuna_bases_private_names(module_name, node.name)
            for inner in ast.walk(node):  # a subclass of an Optuna class using or overriding its privates
                name = (inner.attr if isinstance(inner, ast.Attribute) and _receiver_is_self(inner.value)
                        else inner.name if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
                if name in inherited:
                    say(inner, f"{node.name}: {name} (private to its Optuna base class)")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_only_the_adapter_uses_optunas_private_api():
    optuna_names = _optuna_private_names()
    assert {"_storage", "_trial_id", "_study_id", "_get_stale_trial_ids", "_heartbeat"} <= optuna_names
    found = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != ADAPTER:
                found += _private_optuna_uses(path, optuna_names)
    assert not found, (
        "Optuna's private API used outside sweeps/backends/optuna_adapter.py (add a named function there, "
        "with a docstring saying why the public API does not do it, and call that):\n" + "\n".join(found))


def test_the_scan_finds_each_kind_of_private_use(tmp_path, monkeypatch):
    """The scan above would pass on a scanner that finds nothing: show it what it must catch."""
    module = tmp_path / "scan_probe.py"
    module.write_text(
        "import importlib\n"
        "import optuna.storages._heartbeat\n"
        "from optuna.storages import _CachedStorage\n"
        "from optuna.storages.journal._file import LOCK_FILE_SUFFIX\n"
        "from optuna.storages.journal import JournalFileSymlinkLock\n"
        "def f(study, trial, storage):\n"
        "    importlib.import_module('optuna._experimental')\n"
        "    getattr(storage, '_backend', storage)\n"
        "    return study._storage.get_trial(trial._trial_id)\n"
        "class Lock(JournalFileSymlinkLock):\n"
        "    def release(self):\n"
        "        return self._lock_file, self._mine, self.view._live\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))  # the scan imports it to follow Lock's bases
    found = _private_optuna_uses(module, _optuna_private_names(), root=tmp_path)
    lines = sorted(int(f.split(":")[1]) for f in found)
    assert lines == [2, 3, 4, 7, 8, 9, 9, 12], "\n".join(found)
