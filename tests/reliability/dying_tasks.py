"""User tasks (``task.target``) whose process dies, exits or hangs on purpose, once.

``DIE_HOW`` picks what happens in the first trial's ``datasets()`` (set-up, before any step):
``os_exit_0``, ``os_exit_3``, ``sigkill`` (as the OOM killer does), ``sys_exit``, ``hang``
(sleeps forever), ``hang_ignoring_sigterm``. ``DIE_MARKER`` names a file created first, so it
happens only once per study and a test knows the task got there; ``DIE_ALWAYS=1`` makes it
happen in every trial instead.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from core.tasks import task
from core.tasks.digits import DigitsTask


class DyingTask(DigitsTask):
    def datasets(self):
        how, marker = os.environ.get("DIE_HOW", ""), os.environ.get("DIE_MARKER", "")
        if how and marker and (os.environ.get("DIE_ALWAYS") or not os.path.exists(marker)):
            with open(marker, "w") as fh:
                fh.write(str(os.getpid()))
            if how == "os_exit_0":
                os._exit(0)
            if how == "os_exit_3":
                os._exit(3)
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "sys_exit":
                sys.exit(0)
            if how == "hang_ignoring_sigterm":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if how.startswith("hang"):
                while True:
                    time.sleep(0.5)
        return super().datasets()


@task
def make_dying_task(model: str = "mlp", width: int = 32) -> DyingTask:
    return DyingTask(model, width=width)
