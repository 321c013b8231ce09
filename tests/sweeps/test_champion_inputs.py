"""The registered model checks its input against the task's contract (``Task.natural_input``):
floats and integers of the same pixels get the same answer; NaN, infinity and values outside the
task's range are refused in one line, the whole batch. The pyfunc model is loaded with
``mlflow.pyfunc`` from a real local store, trained in this process."""
from __future__ import annotations

import numpy as np
import pytest

from core.tasks.digits import DigitsTask
from core.tasks.inputs import InputRefused, InputSpec
from sweeps.tracking.mlflow_adapter import fluent_uri
from tests.sweeps.promoted_model import promote_logged, trained_digits, trial_run


@pytest.fixture(scope="module")
def trial_files(tmp_path_factory):
    return trained_digits(tmp_path_factory)


@pytest.fixture(scope="module")
def champion(trial_files, tmp_path_factory):
    """The promoted pyfunc model of a digits trial, loaded from its store; and the validation images."""
    import mlflow.pyfunc

    uri, reader, cand = trial_run(tmp_path_factory.mktemp("store"), trial_files)
    model_uri, _ = promote_logged(uri, reader, cand)
    with fluent_uri(uri):
        model = mlflow.pyfunc.load_model(model_uri)
    task = DigitsTask(model="mlp", width=16)
    return model, task.natural_examples(64).numpy()


def test_the_champion_answers_float64_float32_integer_and_uint8_images_alike(champion):
    model, images = champion
    assert images.dtype == np.float64 and images.min() >= 0 and images.max() <= 16
    expected = np.asarray(model.predict(images))
    assert expected.shape == (64,) and expected.dtype == np.int64
    assert len(set(expected.tolist())) >= 5  # a trained model: the images get various digits
    for dtype in (np.float32, np.int64, np.int32, np.uint8, np.int16):
        np.testing.assert_array_equal(np.asarray(model.predict(images.astype(dtype))), expected, err_msg=str(dtype))
    np.testing.assert_array_equal(np.asarray(model.predict(images.reshape(64, 64).astype(np.uint8))), expected)


@pytest.mark.parametrize("change, needle", [
    (lambda x: np.where(np.arange(len(x))[:, None, None] == 3, np.nan, x), "row 3 of 64 holds NaN or infinity"),
    (lambda x: np.where(np.arange(len(x))[:, None, None] == 7, np.inf, x), "row 7 of 64 holds NaN or infinity"),
    (lambda x: x * 16, "rows 0, 1, 2, 3, 4 and 59 more of 64 hold values outside 0 to 16 (min 0, max 256)"),
    (lambda x: x - 1, "hold values outside 0 to 16 (min -1, max 15)"),
    (lambda x: x.astype(np.complex64), "input of dtype complex64 refused"),
    (lambda x: x.astype(bool), "input of dtype bool refused"),
    (lambda x: x[:, :7, :7], "input sample shaped (7, 7) refused (a batch of 64)"),
])
def test_the_champion_refuses_what_it_cannot_answer_in_one_short_line(champion, change, needle):
    model, images = champion
    bad = change(images.copy())
    with pytest.raises(InputRefused) as caught:
        model.predict(bad)
    message = str(caught.value)
    assert needle in message, message
    assert "\n" not in message and len(message) < 300, message  # never the array itself
    assert "finite float or integer values 0 to 16, each sample shaped (8, 8) or (64,)" in message


def test_one_nan_image_among_good_ones_refuses_the_whole_batch(champion):
    model, images = champion
    batch = images.astype(np.float32)
    batch[10, 4, 4] = np.nan
    batch[20, 0, 0] = 16.5
    with pytest.raises(InputRefused, match=r"row 10 of 64 holds NaN"):
        model.predict(batch)
    batch[10, 4, 4] = 0.0
    with pytest.raises(InputRefused, match=r"row 20 of 64 holds values outside 0 to 16"):
        model.predict(batch)
    batch[20, 0, 0] = 16.0
    assert np.asarray(model.predict(batch)).shape == (64,)


def test_the_contract_checks_rows_of_different_shapes_one_by_one():
    spec = InputSpec(kinds="iu", shapes=((-1, -1, 3),), low=0, high=255)
    rows = np.empty(3, dtype=object)
    rows[:] = [np.zeros((4, 5, 3), np.uint8), np.zeros((6, 2, 3), np.int64), np.full((2, 2, 3), 300, np.int64)]
    with pytest.raises(InputRefused, match=r"row 2 of 3 holds values outside 0 to 255 \(min 0, max 300\)"):
        spec.check(rows)
    rows[2] = np.zeros((2, 2, 3), np.float32)
    with pytest.raises(InputRefused, match="input of dtype float32 refused: the model takes finite integer values"):
        spec.check(rows)
    rows[2] = np.zeros((2, 2, 4), np.uint8)
    with pytest.raises(InputRefused, match=r"sample shaped \(2, 2, 4\) refused"):
        spec.check(rows)
    rows[2] = np.zeros((2, 2, 3), np.uint8)
    spec.check(rows)
    InputSpec().check(np.array([[1e30, -5.0]]))  # no declared range: finite is enough
