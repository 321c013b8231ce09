"""The default validation metric, accuracy, counted without torchmetrics: the same figure as
torchmetrics' MulticlassAccuracy."""
from __future__ import annotations

import pytest
import torch

from core.tasks.accuracy import Accuracy


@pytest.mark.parametrize("shape, as_labels", [((50, 7), False), ((50, 7), True), ((6, 3, 5, 4), False)])
def test_accuracy_equals_torchmetrics_micro_accuracy_over_several_batches(shape, as_labels):
    # Imported here: torchmetrics loads its whole package (seconds), which every test process
    # would otherwise pay while collecting.
    from torchmetrics.classification import MulticlassAccuracy

    gen = torch.Generator().manual_seed(0)
    ours, theirs = Accuracy(), MulticlassAccuracy(num_classes=shape[1], average="micro")
    for _ in range(3):
        scores = torch.randn(shape, generator=gen).softmax(dim=1)
        target = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=gen)
        target[: shape[0] // 2] = scores[: shape[0] // 2].argmax(dim=1)  # some right, some wrong
        preds = scores.argmax(dim=1) if as_labels else scores
        ours.update(preds, target)
        theirs.update(preds, target)
    got = float(ours.compute())
    assert 0.3 < got < 1.0 and got == pytest.approx(float(theirs.compute()), abs=1e-7)


def test_accuracy_counts_afresh_after_reset_and_refuses_predictions_that_do_not_fit():
    acc = Accuracy().to(torch.device("cpu"))
    acc.update(torch.tensor([0, 1, 1]), torch.tensor([1, 1, 1]))
    assert float(acc.compute()) == pytest.approx(2 / 3)
    acc.reset()
    acc.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 1]))
    assert float(acc.compute()) == 1.0 and Accuracy.higher_is_better is True
    with pytest.raises(ValueError, match=r"predictions of shape \(2, 3\) do not fit targets of shape \(3,\)"):
        acc.update(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
