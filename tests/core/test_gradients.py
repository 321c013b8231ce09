"""core.gradients.StepGradients: small gradients pooled in one buffer on CPU train exactly like
PyTorch's fresh gradients, measure the same norm, and leave frozen parameters alone."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core.gradients import POOLED_MAX_ELEMENTS, StepGradients

CPU = torch.device("cpu")


def _model() -> nn.Module:
    # 300 * 256 weights is over the pooling limit: one tensor stays on PyTorch's own path.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 256), nn.ReLU(), nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 10))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 300, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def test_small_tensors_share_one_buffer_and_large_ones_do_not():
    model = _model()
    grads = StepGradients(list(model.parameters()), CPU, distributed=False)
    big = model[0].weight
    assert big.numel() > POOLED_MAX_ELEMENTS and big.grad is None
    (buffer,) = grads.buffers
    assert buffer.numel() == sum(p.numel() for p in model.parameters() if p is not big)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    for p in model.parameters():
        if p is not big:
            assert p.grad is not None and start <= p.grad.data_ptr() < end


def test_pooled_training_is_bitwise_the_same_as_fresh_gradients():
    fresh, pooled = _model(), _model()
    opt_fresh, opt_pooled = _sgd(fresh), _sgd(pooled)
    grads = StepGradients(list(pooled.parameters()), CPU, distributed=False)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in _batches(6):
        loss_fn(fresh(x), y).backward()
        reference_norm = float(torch.nn.utils.get_total_norm([p.grad for p in fresh.parameters()]))
        opt_fresh.step()
        opt_fresh.zero_grad(set_to_none=True)

        loss_fn(pooled(x), y).backward()
        norm = grads.norm()
        opt_pooled.step()
        grads.zero_()
        assert isinstance(norm, float) and norm == pytest.approx(reference_norm, rel=1e-5)
    for a, b in zip(fresh.parameters(), pooled.parameters(), strict=True):
        assert torch.equal(a, b)
    # After zero_(): pooled gradients are zero views, the large one is dropped as set_to_none does.
    assert pooled[0].weight.grad is None
    assert all(float(p.grad.abs().sum()) == 0.0 for p in list(pooled.parameters())[1:])


def test_frozen_parameters_get_no_gradient_and_do_not_move():
    model = _model()
    opt = _sgd(model)
    grads = StepGradients(list(model.parameters()), CPU, distributed=False)
    head = model[4]
    head.weight.requires_grad_(False)
    grads.attach()  # what core.train does at each epoch's start
    assert head.weight.grad is None
    before = head.weight.detach().clone()
    for x, y in _batches(3):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # weight decay and momentum would move it if it had a (zero) gradient
        grads.zero_()
    assert torch.equal(before, head.weight)
    head.weight.requires_grad_(True)
    grads.attach()
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
@pytest.mark.parametrize("where", ["pooled", "large"])
def test_a_non_finite_gradient_gives_a_non_finite_norm(poison, where):
    model = _model()
    grads = StepGradients(list(model.parameters()), CPU, distributed=False)
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    target = model[2].bias if where == "pooled" else model[0].weight
    with torch.no_grad():
        target.grad.view(-1)[0] = poison
    assert not math.isfinite(grads.norm())


def test_without_pooling_it_is_set_to_none_and_the_per_tensor_norm():
    # A DDP rank pools nothing (DDP owns its gradient buckets).
    model = _model()
    grads = StepGradients(list(model.parameters()), CPU, distributed=True)
    assert grads.buffers == [] and all(p.grad is None for p in model.parameters())
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert float(grads.norm()) == pytest.approx(expected, rel=1e-5)
    grads.zero_()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipping every step / never
def test_clip_matches_clip_grad_norm(max_norm):
    reference, pooled = _model(), _model()
    opt_reference, opt_pooled = _sgd(reference), _sgd(pooled)
    grads = StepGradients(list(pooled.parameters()), CPU, distributed=False)
    for x, y in _batches(5):
        nn.functional.cross_entropy(reference(x), y).backward()
        expected = float(nn.utils.clip_grad_norm_(list(reference.parameters()), max_norm=max_norm))
        opt_reference.step()
        opt_reference.zero_grad(set_to_none=True)

        nn.functional.cross_entropy(pooled(x), y).backward()
        norm = grads.clip_(max_norm)
        clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in pooled.parameters()))
        opt_pooled.step()
        grads.zero_()
        assert norm == pytest.approx(expected, rel=1e-5)
        assert clipped == pytest.approx(min(norm, max_norm), rel=1e-4)
    for a, b in zip(reference.parameters(), pooled.parameters(), strict=True):
        if max_norm > 1.0:  # never clipped: nothing was multiplied, so bitwise the same
            assert torch.equal(a, b)
        else:  # the factor may differ in its last bit (computed in double here, float in torch)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_clip_without_pooling_is_torchs():
    model = _model()
    grads = StepGradients(list(model.parameters()), CPU, distributed=True)
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    norm = grads.clip_(0.01)
    assert isinstance(norm, torch.Tensor) and float(norm) > 0.01
    total = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert total == pytest.approx(0.01, rel=1e-3)


def test_cleared_before_backward_on_cpu_and_after_the_step_on_cuda():
    x, y = _batches(1)[0]
    model = _model()
    on_cpu = StepGradients(list(model.parameters()), CPU, distributed=False)
    nn.functional.cross_entropy(model(x), y).backward()
    on_cpu.after_step()  # on CPU the gradients stay until the next backward
    assert model[0].weight.grad is not None and float(model[2].bias.grad.abs().sum()) > 0
    on_cpu.before_backward()
    assert model[0].weight.grad is None and float(model[2].bias.grad.abs().sum()) == 0.0

    model = _model()  # only the device's type is read here: nothing is pooled, so no tensor goes on it
    on_cuda = StepGradients(list(model.parameters()), torch.device("cuda", 0), distributed=False)
    nn.functional.cross_entropy(model(x), y).backward()
    on_cuda.before_backward()
    assert all(p.grad is not None for p in model.parameters())
    on_cuda.after_step()
    assert all(p.grad is None for p in model.parameters())
