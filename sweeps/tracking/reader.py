"""Reading runs back from the tracking store: what ``sweeps status``, ``report``, ``promote``,
``rerun``, ``compare``, recovery and the Ray driver know about runs that trackers wrote.

Kept apart from :class:`sweeps.tracking.base.Tracker` so that code which only writes (a
trial) cannot come to depend on reads, and code which only reads (the dashboards) never
opens a writer with its buffer and spool.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sweeps.errors import RunLookupError
from sweeps.tracking.base import RunHandle
from sweeps.tracking.layout import PARENT_TAG
from sweeps.tracking.local_runs import find_by_client_id, is_local
from sweeps.tracking.values import tag_values


class TrackingReader:
    """Reads the MLflow store at ``tracking_uri`` (``client``: an ``MlflowClient`` to use
    instead of a new one). Thread-safe; the client is made on first use."""

    def __init__(self, tracking_uri: str, client: Any = None) -> None:
        self.tracking_uri = str(tracking_uri)
        self._made_client = client
        self._lock = threading.Lock()
        self._store_ids: dict[str, str] = {}  # local run id -> the store's (sweeps.tracking.local_runs)

    @property
    def _client(self) -> Any:
        if self._made_client is None:
            with self._lock:
                if self._made_client is None:
                    from mlflow.tracking import MlflowClient

                    self._made_client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._made_client

    @property
    def registry(self) -> Any:
        """The MLflow client of the model registry (registered models, versions, aliases,
        logged models), which only ``sweeps promote`` uses; runs are read through the
        methods below."""
        return self._client

    def store_id(self, run_id: str) -> str:
        """The store's id of ``run_id``. A run made while the store was down has a local id in the
        study's records (``local-...``) until its writes reach the store, which tags the run with
        it; RunLookupError (exit 2) while they still wait in a spool."""
        if not is_local(run_id):
            return run_id
        if run_id not in self._store_ids:
            found = find_by_client_id(self._client, run_id)
            if found is None:
                raise RunLookupError(f"MLflow run {run_id!r} was made while the tracking store was unreachable and is "
                                     f"not at {self.tracking_uri} yet: its writes wait in the spool of the machine "
                                     "that ran it, sent by the next sweeps process there or by `sweeps sync-tracking`.")
            self._store_ids[run_id] = found
        return self._store_ids[run_id]

    # -- experiments and runs ------------------------------------------------------------
    def experiment_id(self, name: str) -> str | None:
        """The id of experiment ``name``; None when there is none, or it is deleted."""
        exp = self._client.get_experiment_by_name(name)
        return None if exp is None or exp.lifecycle_stage == "deleted" else exp.experiment_id

    def experiment_name(self, experiment_id: str) -> str:
        return self._client.get_experiment(experiment_id).name

    def get_run(self, run_id: str) -> Any:
        """The MLflow run ``run_id`` (info, params, tags, latest metrics); RunLookupError
        (exit 2) naming the store when it is missing or deleted."""
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(self.store_id(run_id))
        except MlflowException as exc:
            raise RunLookupError(f"MLflow run {run_id!r} not found at {self.tracking_uri}: {str(exc).splitlines()[0]}. "
                                 "Check the id (`mlflow ui`) or the tracking URI.") from exc
        if run.info.lifecycle_stage == "deleted":
            raise RunLookupError(f"MLflow run {run_id!r} at {self.tracking_uri} is deleted; restore it first.")
        return run

    def handle(self, run_id: str) -> RunHandle:
        """A handle on the existing run ``run_id``, to write to it (or nest runs under it)."""
        info = self.get_run(run_id).info
        return RunHandle(info.run_id, info.experiment_id, info.run_name or "")

    def find_runs(self, experiment_id: str, tags: Mapping[str, Any] | None = None, *, status: str | None = None,
                  oldest_first: bool = False, max_results: int = 5000) -> list[Any]:
        """The experiment's runs (not deleted) whose tags include all of ``tags`` and, when
        given, whose status is ``status``; newest first unless ``oldest_first``."""
        wanted = {k: v for k, v in tag_values(tags or {}).items() if v is not None}
        # MLflow's filter grammar has no escapes: a value with a quote is checked below only.
        clauses = [f"tags.`{key}` = '{value}'" for key, value in wanted.items() if "'" not in value]
        if status is not None:
            clauses.append(f"attributes.status = '{status}'")
        order = ["attributes.start_time " + ("ASC" if oldest_first else "DESC")]
        found: list[Any] = []
        token = None
        while len(found) < max_results:
            page = self._client.search_runs([experiment_id], filter_string=" and ".join(clauses), order_by=order,
                                            max_results=min(1000, max_results - len(found)), page_token=token)
            found += [r for r in page if all(r.data.tags.get(k) == v for k, v in wanted.items())]
            token = page.token
            if not token:
                break
        return found[:max_results]

    def find_run(self, experiment_id: str, tags: Mapping[str, Any]) -> RunHandle | None:
        """The most recently started run of the experiment carrying all of ``tags``, or None
        (a study's parent on resume, a Ray trial's own run)."""
        runs = self.find_runs(experiment_id, tags, max_results=1)
        if not runs:
            return None
        info = runs[0].info
        return RunHandle(info.run_id, info.experiment_id, info.run_name or "")

    def runs_with_id_prefix(self, prefix: str, experiment_ids: list[str] | None = None) -> list[Any]:
        """Runs (not deleted) whose id starts with ``prefix`` (lower-case hex), in the given
        experiments or, when None, in every active one; at most 100 (enough to say "ambiguous")."""
        if experiment_ids is None:
            experiment_ids = [e.experiment_id for e in self._client.search_experiments()]
        if not experiment_ids:
            return []
        return list(self._client.search_runs(experiment_ids, filter_string=f"attributes.run_id LIKE '{prefix}%'",
                                             max_results=100))

    def children(self, parent_run_id: str, tags: Mapping[str, Any] | None = None, **kwargs: Any) -> list[Any]:
        """Runs nested under ``parent_run_id`` (in its experiment), as :meth:`find_runs` selects them."""
        parent_run_id = self.store_id(parent_run_id)
        experiment_id = self._client.get_run(parent_run_id).info.experiment_id
        return self.find_runs(experiment_id, {PARENT_TAG: parent_run_id, **(tags or {})}, **kwargs)

    # -- metrics and artifacts -----------------------------------------------------------
    def metric_history(self, run_id: str, key: str) -> list[Any]:
        """Every point of metric ``key`` (``.step``, ``.value``, ``.timestamp``), in no set order."""
        return self._client.get_metric_history(self.store_id(run_id), key)

    def list_artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        """Paths of the artifacts in the folder ``path`` of the run (its root when None)."""
        return [a.path for a in self._client.list_artifacts(self.store_id(run_id), path)]

    def download_artifact(self, run_id: str, path: str, dest: str | Path) -> Path:
        """The artifact ``path`` of the run, copied into the folder ``dest``."""
        return Path(self._client.download_artifacts(self.store_id(run_id), path, str(dest)))
