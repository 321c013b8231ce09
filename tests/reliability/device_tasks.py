"""A user task (``task.target``) that records which devices its process was given.

Each trial's ``datasets()`` writes ``DEVICES_LOG/<pid>.json``: the process's pid, its parent's pid
and its ``CUDA_VISIBLE_DEVICES`` (absent: null). A trial's Optuna user attribute ``worker``
(``host:boot:pid``) names the process, so a test maps every trial to the devices it saw and to
the supervisor that started it (the parent pid)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from core.tasks import task
from core.tasks.digits import DigitsTask


class DeviceRecordingTask(DigitsTask):
    def datasets(self):
        folder = os.environ.get("DEVICES_LOG")
        if folder:
            seen = {"pid": os.getpid(), "ppid": os.getppid(),
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
            Path(folder, f"{os.getpid()}.json").write_text(json.dumps(seen))
        return super().datasets()


@task
def make_device_recording_task(model: str = "mlp", width: int = 32) -> DeviceRecordingTask:
    return DeviceRecordingTask(model, width=width)
