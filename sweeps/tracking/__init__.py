"""Tracking: where a sweep's runs, params, metrics and artifacts go.

``Tracker`` / ``RunHandle`` are the writing interface (``base``), ``MlflowTracker`` its
implementation, ``TrackingReader`` what reads runs back (``reader``), ``sync_spool`` sends
writes kept locally while the store was down. The run layout (names of tags, metrics,
artifact folders) lives in ``layout``.
"""
from sweeps.tracking.base import RUN_STATUSES, RunHandle, RunStatus, Tracker
from sweeps.tracking.mlflow_tracker import MlflowTracker
from sweeps.tracking.reader import TrackingReader
from sweeps.tracking.store_checks import check_store
from sweeps.tracking.sync import sync_command, sync_spool

__all__ = [
    "RUN_STATUSES", "MlflowTracker", "RunHandle", "RunStatus", "Tracker", "TrackingReader",
    "check_store", "sync_command", "sync_spool",
]
