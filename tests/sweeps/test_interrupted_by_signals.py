"""interrupted_by_signals (sweeps/stop_signals.py): a signal inside the block raises at once, handlers are put back."""
from __future__ import annotations

import os
import signal
import time

import pytest

from sweeps.errors import StoppedBySignal
from sweeps.stop_signals import interrupted_by_signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_the_block_raises_with_128_plus_n_and_the_old_handlers_come_back(signum):
    seen = []
    before = signal.signal(signum, lambda n, _f: seen.append(n))
    try:
        with pytest.raises(StoppedBySignal) as info:
            with interrupted_by_signals("waiting for X"):
                os.kill(os.getpid(), signum)
                time.sleep(60)  # a wait the signal ends
                pytest.fail("the signal did not stop the wait")
        assert info.value.exit_code == 128 + signum
        assert str(info.value).startswith(f"stopped by {signal.Signals(signum).name} while waiting for X;")
        os.kill(os.getpid(), signum)  # outside the block: the handler from before takes it
        assert seen == [signum]
    finally:
        signal.signal(signum, before)


def test_without_a_signal_the_block_runs_and_raises_its_own_errors():
    with pytest.raises(ValueError):
        with interrupted_by_signals("waiting for X"):
            raise ValueError("its own")
    with interrupted_by_signals("waiting for X"):
        pass
