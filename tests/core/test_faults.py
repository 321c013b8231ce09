"""The fault points are one declared set (core/faults.py): a name a test writes that is not
declared is refused, and every declared point is marked somewhere in the product's code."""
from __future__ import annotations

import ast
import signal
import threading
from pathlib import Path

import pytest

from core import faults
from core.faults import ENV_FAULT, ENV_PAUSE, Fault, Pause, UnknownFaultPoint

ROOT = Path(__file__).resolve().parents[2]
SEAM = ("armed", "stop_here", "signal_here", "pause_here")


def test_every_point_says_what_it_does_and_names_are_unique():
    points = [*Fault, *Pause]
    assert all(p.meaning.strip() for p in points)
    assert len({p.value for p in points}) == len(points)


@pytest.mark.parametrize("env, call", [(ENV_FAULT, lambda: faults.armed(Fault.MID_CHECKPOINT)),
                                       (ENV_PAUSE, lambda: faults.pause_here(Pause.SPEC_READ)),
                                       (ENV_FAULT, faults.mid_trial_armed)])
def test_a_misspelt_point_is_refused_with_the_declared_names(monkeypatch, env, call):
    monkeypatch.setenv(env, "after_training, mid_chekpoint" if env == ENV_FAULT else "spec_red")
    with pytest.raises(UnknownFaultPoint) as err:
        call()
    message = str(err.value)
    assert env in message and ("'mid_chekpoint'" in message or "'spec_red'" in message)
    assert "mid_checkpoint" in message or "spec_read" in message  # the right names, to fix it with
    with pytest.raises(UnknownFaultPoint):
        faults.check_environment()


def test_a_declared_point_fires_only_when_named(monkeypatch):
    monkeypatch.delenv(ENV_FAULT, raising=False)
    assert not faults.armed(Fault.AFTER_TRAINING) and not faults.mid_trial_armed()
    monkeypatch.setenv(ENV_FAULT, " after_training ,driver_kill_mid_trial")
    assert faults.armed(Fault.AFTER_TRAINING) and not faults.armed(Fault.MID_CHECKPOINT)
    assert faults.mid_trial_armed()
    with pytest.raises(ValueError):  # code passes declared points, never a free string
        faults.armed("after_trainin")  # type: ignore[arg-type]


def test_a_driver_point_signals_this_process_once(monkeypatch):
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    try:
        monkeypatch.setattr(faults, "_SIGNAL_OF", {**faults._SIGNAL_OF, Fault.DRIVER_SIGTERM_AT_END: signal.SIGUSR1})
        monkeypatch.setattr(faults, "_fired", set())
        monkeypatch.setenv(ENV_FAULT, Fault.DRIVER_SIGTERM_AT_END.value)
        faults.signal_here(Fault.DRIVER_SIGTERM_AT_START)  # not named: nothing
        faults.signal_here(Fault.DRIVER_SIGTERM_AT_END)
        faults.signal_here(Fault.DRIVER_SIGTERM_AT_END)  # fired already in this process
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [signal.SIGUSR1]


def test_a_worker_holds_mid_trial_only_for_a_mid_trial_point(monkeypatch):
    stop = threading.Event()
    monkeypatch.setenv(ENV_FAULT, Fault.AFTER_TRAINING.value)
    faults.hold_mid_trial(stop)  # returns at once: no mid-trial point is named
    monkeypatch.setenv(ENV_FAULT, Fault.DRIVER_SIGINT_MID_TRIAL.value)
    stop.set()
    faults.hold_mid_trial(stop)  # waits for the stop, here already set


def _product_files():
    for package in ("core", "sweeps", "dashboards"):
        yield from sorted((ROOT / package).rglob("*.py"))


def test_product_code_calls_the_seam_by_declared_name_only():
    """No call of the seam with a literal string: a point is ``Fault.X`` or ``Pause.X``, so a
    misspelling fails at import, not silently at the moment a test needs the fault."""
    literal = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in SEAM:
                    literal.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not literal, literal


def test_every_declared_point_is_marked_in_the_product():
    text = "\n".join(p.read_text() for p in _product_files() if p.name != "faults.py")
    unused = [p.value for p in Fault if f"Fault.{p.name}" not in text and p not in faults.MID_TRIAL]
    unused += [p.value for p in Pause if f"Pause.{p.name}" not in text and f"'{p.value}'" not in text]
    assert not unused, unused
    assert "faults.trial_mid_way()" in text and "faults.hold_mid_trial(" in text  # the mid-trial points' marks

