"""`sweeps rerun --profile`: one trial trained again under torch.profiler; the Chrome trace and
the top-operator table land in the rerun's MLflow run under profile/."""
from __future__ import annotations

import json

import pytest

from sweeps import cli
from tests.sweeps.study_fixtures import finished_study, in_study  # noqa: F401  (fixtures, asked for by name)

pytestmark = pytest.mark.slow


def test_rerun_profile_logs_the_trace_and_the_operator_table(request, capsys, tmp_path):
    import mlflow

    study = request.getfixturevalue("in_study")  # by name: a parameter would shadow the import (F811)

    client = study.client()
    original = study.trial_runs()[2]
    assert cli.main(["rerun", str(study.spec), "--trial", "2", "--profile"]) == 0
    capsys.readouterr()
    [rerun] = client.search_runs([original.info.experiment_id],
                                 f"tags.`rerun_of` = '{original.info.run_id}' and tags.`sweeps.role` = 'rerun'",
                                 order_by=["attributes.start_time DESC"], max_results=1)
    names = sorted(a.path for a in client.list_artifacts(rerun.info.run_id, "profile"))
    assert names == ["profile/top_ops_1.txt", "profile/trace_1.json"]
    local = mlflow.artifacts.download_artifacts(run_id=rerun.info.run_id, artifact_path="profile/trace_1.json",
                                                dst_path=str(tmp_path), tracking_uri=client.tracking_uri)
    events = json.loads(open(local).read())["traceEvents"]
    # train.profile's defaults: wait 1, warmup 1, active 3
    assert sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}) == [
        "ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    # the original trial was not profiled
    assert client.list_artifacts(original.info.run_id, "profile") == []
