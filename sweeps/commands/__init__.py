"""The ``sweeps`` subcommands. Each module of this package lists the ones it defines in
``COMMANDS`` (a tuple of :class:`Command`); ``sweeps.cli`` builds the parser from those lists, in
one place.

What every command module shares lives here: the :class:`Command` record it declares its
subcommands with, the consoles it prints on, and how it reads the spec named on the command
line. Kept apart from ``sweeps.cli`` so that the command modules never import the CLI module: the
CLI imports them, and ``python -m sweeps.cli`` (which runs cli.py as ``__main__``) has no second
copy of it for them to import.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

console = Console(soft_wrap=True)  # long paths and messages stay on one line (grep-able, copy-able)
err_console = Console(stderr=True, soft_wrap=True)


@dataclass(frozen=True)
class Command:
    """One subcommand: ``sweeps <name>``. ``add_arguments`` fills its parser; ``handler`` runs it
    with the parsed arguments and returns the exit code (a SweepsError raised there becomes a
    message and the error's exit code in ``sweeps.cli.main``)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


def spec_argument(p: argparse.ArgumentParser) -> None:
    """The one positional argument of commands that only read a spec."""
    p.add_argument("spec", help="study spec YAML file")


def load_spec_file(path: str):
    """The study spec at ``path``, validated (a SpecError, exit 2, lists every problem)."""
    from sweeps.spec.load import load_spec  # lazy: pydantic and the spec checks are not needed for --help

    return load_spec(path)
