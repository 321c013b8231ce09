"""``sweeps promote`` with a corrupt, truncated or crafted ONNX artifact in the trial's run: refused
(exit 2) naming the run, the artifact and the fix, with nothing logged; never onnx's ``DecodeError``
or onnxruntime's raw error as a crash. A trial trained in this process, in a real local store."""
from __future__ import annotations

import pytest

from sweeps.errors import ArtifactError
from tests.sweeps.promoted_model import promote_logged, trained_digits, trial_run


@pytest.fixture(scope="module")
def trial_files(tmp_path_factory):
    return trained_digits(tmp_path_factory)


def _refusal(trial_files, tmp_path, onnx: bytes) -> ArtifactError:
    uri, reader, cand = trial_run(tmp_path, trial_files, onnx=onnx)
    with pytest.raises(ArtifactError) as caught:
        promote_logged(uri, reader, cand)
    message = str(caught.value)
    assert caught.value.exit_code == 2
    assert f"trial 0 (run {cand.run_id})" in message and "onnx/model.onnx" in message
    assert "Nothing was promoted" in message and f"set_tag('{cand.run_id}', 'sweeps.onnx_parity_passed'" in message
    assert "log_artifact(" in message and "\n" not in message
    assert not reader.registry.search_logged_models([cand.run.info.experiment_id])  # nothing half-written
    return caught.value


def test_a_corrupt_onnx_artifact_is_refused_naming_the_run_the_artifact_and_the_fix(trial_files, tmp_path):
    good = (trial_files.folder / "model.onnx").read_bytes()
    assert "DecodeError" in str(_refusal(trial_files, tmp_path / "a", b"\x08\xff\xff\xff\xff\xff" + good[7:200]))
    _refusal(trial_files, tmp_path / "b", good[: len(good) // 2])  # truncated


def test_a_crafted_onnx_model_that_takes_other_inputs_is_refused(trial_files, tmp_path):
    """A valid ONNX file, but of a model taking (N, 3) inputs: onnxruntime's own error, in the refusal."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["input"], ["output"])], "crafted",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3])])
    crafted = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    error = _refusal(trial_files, tmp_path, crafted.SerializeToString())
    assert "ONNXRuntimeError" in str(error) or "INVALID_ARGUMENT" in str(error)
    onnx.checker.check_model(crafted)  # the file itself is well formed: only running it tells
