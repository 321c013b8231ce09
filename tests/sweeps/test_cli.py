"""The ``sweeps`` parser: built in one place from the commands' own declarations, ``--version``,
and a broken command module that fails loudly instead of hiding its command."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from sweeps import cli
from sweeps.commands import Command
from tests.sweeps.study_helpers import write_spec

EVERY_COMMAND = ["validate", "run", "worker", "status", "sync-tracking", "repair-journal", "check", "doctor", "slurm",
                 "promote", "rerun", "compare", "report"]


def test_every_command_is_declared_once_in_help_order():
    assert [c.name for c in cli.COMMANDS] == EVERY_COMMAND


def test_the_parser_is_built_from_the_table_it_is_given():
    seen: list[argparse.Namespace] = []

    def hello(a: argparse.Namespace) -> int:
        seen.append(a)
        return 7

    table = (Command("hello", "say hello", lambda p: p.add_argument("--who", default="world"), hello),)
    a = cli.build_parser(table).parse_args(["hello", "--who", "you"])
    assert (a.command, a.who, a.func(a)) == ("hello", "you", 7) and seen == [a]


def test_status_has_its_format_option():
    parser = cli.build_parser()
    assert parser.parse_args(["status", "s.yaml"]).format == "table"
    assert parser.parse_args(["status", "s.yaml", "--format", "json"]).format == "json"


def test_version_prints_the_installed_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"sweeps {version('sweeps')}\n"


def test_version_without_package_metadata_says_how_to_install(capsys, monkeypatch):
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "sweeps is not installed" in err and "pip install -e ." in err and "Traceback" not in err


def test_a_command_module_that_cannot_be_imported_stops_the_cli():
    # None in sys.modules makes `import sweeps.commands.after_sweep` raise ModuleNotFoundError naming
    # that module: the CLI must not start without the command.
    code = "import sys; sys.modules['sweeps.commands.after_sweep'] = None; import sweeps.cli; sweeps.cli.build_parser()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "ModuleNotFoundError" in proc.stderr and "sweeps.commands.after_sweep" in proc.stderr


# ---- errors --------------------------------------------------------------------------------------
def test_an_unknown_backend_is_a_sweeps_error_with_exit_2():
    from sweeps.backends.by_name import get_backend
    from sweeps.errors import SweepsError, UnknownBackendError

    with pytest.raises(UnknownBackendError) as info:
        get_backend("tune", "studies/x.yaml")
    assert isinstance(info.value, SweepsError) and isinstance(info.value, ValueError)
    assert info.value.exit_code == 2
    assert str(info.value) == ("studies/x.yaml: backend: 'tune' is not one of optuna, ray; write backend: "
                               "optuna (the default) or backend: ray in the study spec")


@pytest.mark.parametrize("command", ["status", "run"])
def test_the_cli_names_an_unknown_backend_in_one_line_and_exits_2(command, tmp_path, capsys, monkeypatch):
    # A spec file cannot hold an unknown backend (validation refuses it first); a spec built in
    # code can, so the command is handed one.
    from sweeps.commands import study
    from sweeps.spec.load import load_spec
    from tests.sweeps.study_helpers import write_spec

    path = write_spec(tmp_path, name="nobackend", seed_store=False)
    bad = load_spec(path).model_copy(update={"backend": "tune"})
    monkeypatch.setattr(study, "load_spec_file", lambda _: bad)
    assert cli.main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {path}: backend: 'tune' is not one of optuna, ray; write backend: optuna (the "
                   "default) or backend: ray in the study spec\n")


def test_run_with_a_bad_spec_exits_2_naming_each_field_and_creates_nothing(in_tmp, capsys):
    """Validation and the exit code are the CLI's own: run in this process (no study starts)."""
    spec = write_spec(in_tmp, name="bad", seed_store=False,
                      search={"lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}},
                      budget={"n_trials": 0})
    before = sorted(p.name for p in in_tmp.iterdir())
    assert cli.main(["run", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "search.lr" in err and "budget.n_trials" in err and "Traceback" not in err
    assert sorted(p.name for p in in_tmp.iterdir()) == before


def test_validate_warns_that_an_empty_search_trains_one_configuration_again_and_again(tmp_path, capsys):
    from tests.sweeps.study_helpers import save_spec, tiny_spec

    empty = save_spec(tmp_path, tiny_spec("empty", search={}, budget={"n_trials": 4}), seed_store=False)
    one = save_spec(tmp_path, tiny_spec("one", search={}, budget={"n_trials": 1}), seed_store=False)
    assert cli.main(["validate", str(empty), str(one)]) == 0  # valid: a warning, not an error
    err = capsys.readouterr().err
    assert (f"warning: {empty}: search is empty, so each of the 4 trials trains the same configuration with "
            "the same seed; add a parameter to search, or set budget.n_trials: 1") in " ".join(err.split())
    assert str(one) not in err  # one trial of one configuration is what it says
