"""Runs created while the tracking store is unreachable, so that trials keep running through an
MLflow outage of any length.

Every run a tracker creates carries a client-made id in the tag ``sweeps.client_run_id``. When
the store cannot take ``create run``, the trial goes on under that id (``local-<hex>``): the
creation is the first record of the run's spool (``["new", experiment_id, run_name, tags]``)
and everything the trial writes queues behind it. Whoever drains the spool first (the tracker
when the store answers again, any later process that reaches the store, or ``sweeps
sync-tracking``) creates the run, nested as it would have been, and sends the rest to it.

Exactly once: before creating, the drain looks the client id up on the store, so a creation
that reached the store but whose answer was lost (a timeout), or a drain cut short between the
creation and the map below, adopts that run instead of making a second one. The store's id is
then kept beside the spool (``<local id>.real``) for later writes from this machine; readers on
any machine find the run by its tag (:func:`find_by_client_id`).
"""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

from sweeps.safe_names import safe_component
from sweeps.tracking.layout import PARENT_TAG

TAG_CLIENT_ID = "sweeps.client_run_id"
LOCAL_PREFIX = "local-"


class ParentNotCreated(ConnectionError):
    """The run's parent was itself created locally and is not on the store yet: retry later
    (a ConnectionError, so the spool treats it as transient and keeps the records)."""


def new_client_id() -> str:
    return LOCAL_PREFIX + uuid.uuid4().hex


def is_local(run_id: str) -> bool:
    return run_id.startswith(LOCAL_PREFIX)


def new_run_record(experiment_id: str, run_name: str, tags: dict[str, str]) -> list[Any]:
    """The spool record that creates the run (the first record of a local run's spool)."""
    return ["new", experiment_id, run_name, dict(tags)]


def _map_path(spool_dir: Path, local_id: str) -> Path:
    return Path(spool_dir) / f"{safe_component(local_id, 'run id')}.real"


def known_store_id(spool_dir: Path, local_id: str) -> str | None:
    """The store's id of a local run created from this spool folder, or None (not yet)."""
    with contextlib.suppress(FileNotFoundError):
        return _map_path(spool_dir, local_id).read_text(encoding="ascii").strip() or None
    return None


def remember_store_id(spool_dir: Path, local_id: str, run_id: str) -> None:
    target = _map_path(spool_dir, local_id)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(run_id)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)


def find_by_client_id(client: Any, local_id: str, experiment_ids: list[str] | None = None) -> str | None:
    """The store's id of the run tagged with ``local_id``, or None. Every active experiment
    when ``experiment_ids`` is None (a reader holding only an id from the study's storage)."""
    if experiment_ids is None:
        experiment_ids = [e.experiment_id for e in client.search_experiments()]
    if not experiment_ids:
        return None
    runs = client.search_runs(experiment_ids, filter_string=f"tags.`{TAG_CLIENT_ID}` = '{local_id}'",
                              max_results=1)
    return runs[0].info.run_id if runs else None


def store_id_for(spool_dir: Path, client: Any, local_id: str, record: list[Any] | None) -> str | None:
    """The store's id of local run ``local_id``, creating the run from its ``new`` record when
    the store has none; None when it was never created and no record says how (the spool's
    head was lost). Raises the store's transient errors, and ParentNotCreated."""
    known = known_store_id(spool_dir, local_id)
    if known is not None:
        return known
    experiment_ids = [record[1]] if record is not None and record[1] else None
    found = find_by_client_id(client, local_id, experiment_ids)
    if found is None and record is not None:
        _, experiment_id, run_name, tags = record
        parent = tags.get(PARENT_TAG, "")
        if is_local(parent):
            real_parent = known_store_id(spool_dir, parent) or find_by_client_id(client, parent, [experiment_id])
            if real_parent is None:
                raise ParentNotCreated(f"parent run {parent} of {local_id} is not on the store yet")
            tags = {**tags, PARENT_TAG: real_parent}
        found = client.create_run(experiment_id, tags={**tags, TAG_CLIENT_ID: local_id}, run_name=run_name).info.run_id
    if found is not None:
        remember_store_id(spool_dir, local_id, found)
    return found
