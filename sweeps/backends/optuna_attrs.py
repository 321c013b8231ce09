"""The names under which sweeps keeps its records in an Optuna study's and trials' user
attributes, and how often one set of parameters is retried.

The study's records (:mod:`sweeps.backends.optuna_study`) and the recovery of dead workers'
trials (:mod:`sweeps.backends.optuna_recovery`, which the study's storage calls back) both read
them, so they import nothing."""
from __future__ import annotations

MAX_RETRIES = 3  # times one set of parameters is requeued after a crash
ATTR_PARENT_RUN = "mlflow_parent_run_id"
ATTR_SEARCH = "search_space"
ATTR_SPEC_HASH = "spec_hash"
ATTR_OUT_DIR = "out_dir"
ATTR_RUN_ID = "mlflow_run_id"
ATTR_WORKER = "worker"
ATTR_REASON = "fail_reason"
ATTR_BATCH_OVERRIDES = "train_overrides"
ATTR_PACK = "pack"  # resources.pack: how the trial trained ("packed with trials ..." or "alone: why")
ATTR_N_TRIALS = "n_trials"  # the budget as raised by sweeps run --add-trials, above the spec's
ATTR_JUDGED_BY = "judged_by"  # training, objectives, constraints, deploy (sweeps.spec.objectives.judged_by)
ATTR_STUDY_UID = "study_uid"  # a UUID made when the study is created: its identity beyond its name
