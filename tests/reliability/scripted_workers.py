"""Workers that live in the test's process, for the supervisor's bookkeeping contract
(``Supervisor.spawner``): each takes trials from the real study in a real journal storage and
ends as its script says (an exit code, a signal's negative code, a hang), so that what the
supervisor does about it (the cause it records, the MLflow run it closes, the requeue, the fresh
worker, the verdict) is checked without a process of its own. What a real worker process does
(its signals, its exit codes through a fork, a task that ends the process) is tested end to end
elsewhere (test_worker_lifecycle, test_process_faults)."""
from __future__ import annotations

import itertools
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from mlflow.tracking import MlflowClient

from sweeps.backends import optuna_adapter, optuna_attrs, optuna_study
from sweeps.backends import optuna_recovery as recovery
from sweeps.backends.supervisor import Supervisor
from sweeps.backends.worker_protocol import WorkerGo
from sweeps.slot_plan import WorkerSlot
from sweeps.spec import search_space as ss
from sweeps.spec.load import spec_from_dict
from sweeps.spec.model import StudySpec
from sweeps.worker_identity import worker_identity
from tests.sweeps.study_helpers import migrated_store, tiny_spec

# Above the kernel's largest pid (2**22): a scripted worker's pid is never a real process's.
_PIDS = itertools.count(5_000_000)
COMPLETE = "complete"  # takes trials until the budget is met, each COMPLETE; exits 0
HANG = "hang"  # takes a trial and makes no progress until it is killed (SIGTERM included)
# Takes a trial, which another worker's stale-trial check fails and requeues, and exits 0 with its
# retry WAITING: a worker that looked for trials between the FAIL and the enqueue.
LEAVES_A_RETRY = "leaves_a_retry"


@dataclass(frozen=True)
class Dies:
    """Takes a trial (unless ``before_a_trial``), leaves it RUNNING and exits with ``code``
    (negative: killed by that signal, as ``Popen.returncode`` says)."""

    code: int
    before_a_trial: bool = False
    # Exits right after a look of the supervisor found it running: between its look for exits and
    # its look for a worker still alive, as a process may.
    between_looks: bool = False


class _Stdin:
    """The go pipe: the supervisor writes one line and closes it."""

    def __init__(self) -> None:
        self.text, self.closed = "", False

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def close(self) -> None:
        self.closed = True


class ScriptedWorker:
    """A :class:`~sweeps.backends.worker_forkserver.WorkerProcess` whose work happens while the
    supervisor first waits for it after its go (``wait``), in the supervisor's thread: between
    two of the supervisor's looks at its workers, as a process's exit would."""

    def __init__(self, workers: ScriptedWorkers, act) -> None:
        self.pid = next(_PIDS)
        self.stdin = _Stdin()
        self.returncode: int | None = None
        self.signals: list[int] = []
        self._workers, self._act, self._acted = workers, act, False

    def poll(self) -> int | None:
        if isinstance(self._act, Dies) and self._act.between_looks and self._ready():
            self._act_now()
            return None  # this look saw it running; the next sees its exit
        return self.returncode

    def _ready(self) -> bool:
        return self.returncode is None and not self._acted and self.stdin.closed

    def _act_now(self) -> None:
        self._acted = True
        go = WorkerGo.from_line(self.stdin.text)
        self.returncode = self._workers.act(self, self._act, Path(go.beat_file))

    def wait(self, timeout: float | None = None) -> int:
        if self._ready():
            self._act_now()
        if self.returncode is None:
            time.sleep(min(timeout or 0.05, 0.05))  # a hung worker: the supervisor's loop goes round
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"scripted worker {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)  # a hung worker makes no progress, so it never stops on its own

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -signal.SIGKILL


@dataclass
class ScriptedWorkers:
    """The spawner: the n-th worker started acts as ``script[n]`` (then :data:`COMPLETE`)."""

    spec: StudySpec
    study: optuna.Study
    script: list
    started: list[ScriptedWorker] = field(default_factory=list)

    def __call__(self, slot: WorkerSlot) -> ScriptedWorker:
        act = self.script[len(self.started)] if len(self.started) < len(self.script) else COMPLETE
        worker = ScriptedWorker(self, act)
        self.started.append(worker)
        return worker

    def _begin(self, worker: ScriptedWorker, beat: Path) -> optuna.Trial:
        """A trial as a worker begins one: asked, named with its worker, its MLflow run made, a beat."""
        trial = self.study.ask()
        ss.suggest(trial, optuna_study.effective_search(self.spec, self.study))
        trial.set_user_attr(optuna_attrs.ATTR_WORKER, worker_identity(worker.pid))
        client = MlflowClient(self.spec.tracking_store_uri())
        experiment = client.get_experiment_by_name(self.spec.name)
        exp_id = experiment.experiment_id if experiment else client.create_experiment(self.spec.name)
        run = client.create_run(exp_id, run_name=f"trial-{trial.number:04d}", tags={"sweeps.role": "trial"})
        trial.set_user_attr(optuna_attrs.ATTR_RUN_ID, run.info.run_id)
        beat.touch()
        return trial

    def act(self, worker: ScriptedWorker, act, beat: Path) -> int | None:
        if act == COMPLETE:
            while optuna_study.budget_left(self.study, self.spec.budget.n_trials) > 0:
                trial = self._begin(worker, beat)
                MlflowClient(self.spec.tracking_store_uri()).set_terminated(trial.user_attrs[optuna_attrs.ATTR_RUN_ID])
                self.study.tell(trial, 0.5)
            return 0
        if act == LEAVES_A_RETRY:
            trial = self._begin(worker, beat)
            recovery.fail_trial(self.study, optuna_adapter.stored_trial(self.study, trial), "heartbeat lost",
                                requeue=True, tracking_uri=self.spec.tracking_store_uri(), interrupted=True)
            return 0
        if act == HANG:
            self._begin(worker, beat)
            return None
        if not act.before_a_trial:
            self._begin(worker, beat)
        return act.code


def supervised(tmp_path: Path, script: list, **overrides) -> tuple[Supervisor, ScriptedWorkers]:
    """A supervisor of the tiny study (journal storage and MLflow store in ``tmp_path``) whose
    workers act as ``script`` says, one slot."""
    spec = spec_from_dict(tiny_spec("supervised", storage=str(tmp_path / "supervised.journal"),
                                    tracking={"uri": migrated_store(tmp_path)}, **overrides))
    study = optuna_study.open_study(spec)
    workers = ScriptedWorkers(spec, study, script)
    since = time.time()

    def go_for(slot: WorkerSlot, beat: Path) -> WorkerGo:
        return WorkerGo(spec_text="", spec_path="", study_name=study.study_name, study_uid="", parent_run_id="",
                        parent_experiment_id="", parent_run_name="", since=since, deadline=None,
                        slot=slot.index, threads=1, beat_file=str(beat))

    supervisor = Supervisor(spec, study, go_for, tmp_path / ".workers", since, None, lambda: None, spawner=workers)
    return supervisor, workers


ONE_SLOT = [WorkerSlot(0, (), 1)]
