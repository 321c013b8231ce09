"""The peer benchmark's clock for "time to the first trial step", the same for every arm.

Python imports this module at start-up when its folder is on ``PYTHONPATH`` (``bench_peers`` puts
it there for every arm, and nothing else does). With ``SWEEPS_BENCH_FIRST_STEP=<file>`` set, once
``torch.optim.optimizer`` is imported it registers a global optimizer step hook: the first
optimizer step that completes in any process of the arm's tree (the driver, a forked or spawned
worker, a thread) creates the file with the wall-clock time in it; every later one finds the file
there. Each process unhooks itself after its first step, so the steps after cost nothing.
Stdlib only: importing torch here would move the arm's import time.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

ENV_FIRST_STEP = "SWEEPS_BENCH_FIRST_STEP"
_TARGET = "torch.optim.optimizer"


def _stamp_once(path: str, handle: list) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        os.write(fd, f"{time.time():.6f}\n".encode())
        os.close(fd)
    if handle:
        handle.pop().remove()


class _HookOptimizerSteps(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch.optim.optimizer`` is about to load, it wraps the module's
    loader so that the step hook is registered as soon as the module has run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name, import_path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # the real finders answer from here on
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module, path = spec.loader.exec_module, self.path

        def exec_module(module) -> None:
            run_module(module)
            handle: list = []
            handle.append(module.register_optimizer_step_post_hook(
                lambda _opt, _args, _kwargs: _stamp_once(path, handle)))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get(ENV_FIRST_STEP):
    sys.meta_path.insert(0, _HookOptimizerSteps(os.environ[ENV_FIRST_STEP]))
