"""A spec names a declared task, never an arbitrary callable: ``task.target`` reaches only what
its module declared with ``@task`` (``core.tasks.task``), ``task.name`` a built-in or a
``sweeps.tasks`` entry point. Checked through the real CLI: an undeclared target is a spec
error (exit 2) for ``validate`` and ``run``, it never runs, and nothing is created. Every command
runs the CLI's main in this process (:func:`cli_in_process`): the user's module, and the folder an
entry point's distribution is installed in, are put on ``sys.path`` as PYTHONPATH puts them there,
and a study's workers, forked from this process's fork server, take its ``sys.path``."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tests.sweeps.study_helpers import cli_in_process, load_study, write_spec

# Each would do harm if called with these arguments: create PWNED, or delete victim.txt.
HARMFUL = {
    "os:system": {"command": "touch PWNED"},
    "subprocess:run": {"args": ["touch", "PWNED"]},
    "os:remove": {"path": "victim.txt"},
    "builtins:eval": {},  # eval's arguments are positional-only; the target alone must be refused
}

USER_TASKS = '''\
from core.tasks import task
from core.tasks.digits import DigitsTask


@task
def make_tiny(model: str = "mlp", width: int = 32) -> DigitsTask:
    return DigitsTask(model=model, width=width)


@task("tiny digits")
class TinyDigits(DigitsTask):
    pass


class Unmarked(TinyDigits):  # a subclass of a declared task is not declared itself
    pass


def helper(model: str = "mlp") -> DigitsTask:  # a task, but not declared: a spec may not call it
    open("PWNED", "w").close()
    return DigitsTask(model=model)


class _Anything:
    """Answers every attribute (as some proxies do) and is callable: must not pass for declared."""

    def __getattr__(self, name):
        return True

    def __call__(self, **kwargs):
        open("PWNED", "w").close()


anything = _Anything()
'''


def _target_spec(folder: Path, target: str, args: dict, **overrides) -> Path:
    return write_spec(folder, name="pw", seed_store=False, budget={"n_trials": 1},
                      task={"name": None, "model": None, "target": target, "args": args}, **overrides)


def _assert_refused(proc, spec: Path, target: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{spec}: 1 problem" in proc.stderr  # the target is the only thing wrong with the spec
    assert f"task.target: {target!r} is not a declared task" in proc.stderr
    assert "@task" in proc.stderr and "'sweeps.tasks' entry point" in proc.stderr  # how to declare one


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("target", sorted(HARMFUL))
def test_undeclared_callables_are_refused_and_never_called(tmp_path, command, target):
    (tmp_path / "victim.txt").write_text("still here")
    spec = _target_spec(tmp_path, target, HARMFUL[target])
    proc = cli_in_process(tmp_path, command, str(spec), *(["--quiet"] if command == "run" else []))
    _assert_refused(proc, spec, target)
    assert not (tmp_path / "PWNED").exists()
    assert (tmp_path / "victim.txt").read_text() == "still here"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("target", ["user_tasks:helper", "user_tasks:Unmarked", "user_tasks:anything"])
def test_undeclared_callables_of_a_user_module_are_refused(tmp_path, monkeypatch, target):
    (tmp_path / "user_tasks.py").write_text(USER_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_tasks", raising=False)  # this test's module, not another's
    spec = _target_spec(tmp_path, target, {})
    for args in (("validate", str(spec)), ("run", str(spec), "--quiet")):
        _assert_refused(cli_in_process(tmp_path, *args), spec, target)
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow  # a study
def test_declared_targets_validate_and_a_declared_factory_runs_end_to_end(tmp_path, monkeypatch):
    (tmp_path / "user_tasks.py").write_text(USER_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_tasks", raising=False)
    cls_spec = write_spec(tmp_path, name="cls", seed_store=False,
                          task={"name": None, "model": "mlp", "target": "user_tasks:TinyDigits", "args": {"width": 16}})
    proc = cli_in_process(tmp_path, "validate", str(cls_spec))
    assert proc.returncode == 0, proc.stderr
    # A declared task is still checked: the name given with @task("...") labels it in messages.
    bad = write_spec(tmp_path, name="bad", seed_store=False,
                     task={"name": None, "model": "mlp", "target": "user_tasks:TinyDigits", "args": {"colour": 2}})
    proc = cli_in_process(tmp_path, "validate", str(bad))
    assert proc.returncode == 2 and "task.args.colour: task 'tiny digits' has no argument 'colour'" in proc.stderr

    spec = write_spec(tmp_path, name="mine", budget={"n_trials": 1}, train={"epochs": 1},
                      task={"name": None, "model": "mlp", "target": "user_tasks:make_tiny", "args": {"width": 16}})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [t.state.name for t in load_study(tmp_path, "mine").trials] == ["COMPLETE"]
    assert not (tmp_path / "PWNED").exists()


def _install_entry_point(site: Path) -> None:
    """A distribution as pip leaves it: a module and a dist-info with an entry_points.txt."""
    (site / "ep_tasks.py").write_text(textwrap.dedent("""\
        from core.tasks.digits import DigitsTask

        def make(model: str = "mlp", width: int = 32) -> DigitsTask:  # declared by the entry point alone
            return DigitsTask(model=model, width=width)
        """))
    info = site / "ep_tasks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-tasks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sweeps.tasks]\ntiny_ep = ep_tasks:make\n")


@pytest.mark.slow  # a study
def test_an_entry_point_task_runs_by_name(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _install_entry_point(site)
    monkeypatch.syspath_prepend(str(site))  # importlib.metadata finds the dist-info on sys.path
    monkeypatch.delitem(sys.modules, "ep_tasks", raising=False)
    spec = write_spec(tmp_path, name="ep", budget={"n_trials": 1}, train={"epochs": 1},
                      task={"name": "tiny_ep", "model": "mlp", "args": {"width": 16}})
    proc = cli_in_process(tmp_path, "validate", str(spec))
    assert proc.returncode == 0, proc.stderr
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [t.state.name for t in load_study(tmp_path, "ep").trials] == ["COMPLETE"]

    # The entry point declares the name, not the function: as a target it is still undeclared.
    target = _target_spec(tmp_path, "ep_tasks:make", {"width": 16})
    _assert_refused(cli_in_process(tmp_path, "validate", str(target)), target, "ep_tasks:make")
    # An unknown name lists the entry points among the tasks.
    unknown = write_spec(tmp_path, name="unk", seed_store=False, task={"name": "tiny_epp"})
    proc = cli_in_process(tmp_path, "validate", str(unknown))
    assert proc.returncode == 2 and "tiny_ep" in proc.stderr and "did you mean 'tiny_ep'" in proc.stderr.lower()
