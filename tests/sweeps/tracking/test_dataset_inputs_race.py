"""Two workers whose first trials start together log the same dataset at once: MLflow's SQL store
checks for the dataset, finds none in both, and the second insert breaks the table's unique key.
The run's inputs are then logged by a second try, which finds the row the other inserted. The
collision is played deterministically: the other worker's insert lands between the first try's
check and insert, which is what the store's error says happened."""
from __future__ import annotations

import sqlalchemy.exc
from mlflow.exceptions import MlflowException, RestException
from mlflow.protos.databricks_pb2 import BAD_REQUEST
from mlflow.tracking import MlflowClient

from sweeps.tracking.send import send_records
from tests.sweeps.study_helpers import migrated_store

DIGITS = [{"name": "digits-train", "source": "task:digits", "digest": "285ac81a", "context": "training",
           "profile": {"num_rows": 1437}}]


class _LosesTheRace:
    """The store's client, whose first ``log_inputs`` loses the race to another worker's."""

    def __init__(self, client: MlflowClient, other_run: str) -> None:
        self.client, self.other_run, self.tries = client, other_run, 0

    def log_inputs(self, run_id, datasets):
        self.tries += 1
        if self.tries == 1:
            self.client.log_inputs(self.other_run, datasets=datasets)  # the other worker's insert, first
            cause = sqlalchemy.exc.IntegrityError("INSERT INTO datasets ...", {}, Exception(
                "UNIQUE constraint failed: datasets.experiment_id, datasets.name, datasets.digest"))
            raise MlflowException(message=cause, error_code=BAD_REQUEST) from cause  # as MLflow's session does
        return self.client.log_inputs(run_id, datasets=datasets)


def test_a_dataset_logged_by_two_workers_at_once_is_an_input_of_both_runs(tmp_path):
    client = MlflowClient(migrated_store(tmp_path))
    exp = client.create_experiment("race", artifact_location=(tmp_path / "art").as_uri())
    mine, other = (client.create_run(exp).info.run_id for _ in range(2))
    racing = _LosesTheRace(client, other)
    counts, refusals = send_records(racing, mine, [["in", DIGITS]], on_done=lambda n: None)
    assert refusals == [] and counts["inputs"] == 1 and racing.tries == 2
    for run_id in (mine, other):
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert [(d.dataset.name, d.dataset.digest) for d in inputs] == [("digits-train", "285ac81a")]


def test_the_collision_answered_by_a_tracking_server_is_tried_again_too(tmp_path):
    """Through an MLflow server the store's error arrives as the server's 400 answer, its text
    naming the driver's error: the same collision, tried again the same way."""
    client = MlflowClient(migrated_store(tmp_path))
    exp = client.create_experiment("race", artifact_location=(tmp_path / "art").as_uri())
    mine, other = (client.create_run(exp).info.run_id for _ in range(2))

    class _ServerLosesTheRace(_LosesTheRace):
        def log_inputs(self, run_id, datasets):
            self.tries += 1
            if self.tries == 1:
                self.client.log_inputs(self.other_run, datasets=datasets)
                raise RestException({"error_code": "BAD_REQUEST", "message": (
                    "(psycopg.errors.UniqueViolation) duplicate key value violates unique constraint "
                    '"uq_dataset_experiment_id_name_digest"')})
            return self.client.log_inputs(run_id, datasets=datasets)

    racing = _ServerLosesTheRace(client, other)
    counts, refusals = send_records(racing, mine, [["in", DIGITS]], on_done=lambda n: None)
    assert refusals == [] and counts["inputs"] == 1 and racing.tries == 2
    assert [d.dataset.name for d in client.get_run(mine).inputs.dataset_inputs] == ["digits-train"]


def test_any_other_refusal_of_the_inputs_is_reported_not_retried(tmp_path):
    class _Refuses:
        tries = 0

        def log_inputs(self, run_id, datasets):
            self.tries += 1
            raise MlflowException("dataset name too long", error_code=BAD_REQUEST)

    refusing = _Refuses()
    counts, refusals = send_records(refusing, "r1", [["in", DIGITS]], on_done=lambda n: None)
    assert refusing.tries == 1 and counts["inputs"] == 0
    assert len(refusals) == 1 and "dataset name too long" in refusals[0]
