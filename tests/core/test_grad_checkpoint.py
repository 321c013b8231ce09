"""Gradient checkpointing of a task's named blocks: the activations kept for backward shrink, and
training gives the same weights and BatchNorm statistics as without it."""
from __future__ import annotations

import pytest
import torch

from core import checkpoint as ckpt
from core.grad_checkpoint import checkpoint_blocks
from core.tasks.base import TaskError
from core.tasks.synthetic import SyntheticTask
from core.train import train
from tests.core.helpers import fast_config

BLOCKS = ["layer1", "layer2", "layer3", "layer4"]


def _task(blocks=()) -> SyntheticTask:
    return SyntheticTask("resnet18", shape=(3, 16, 16), n_train=32, n_val=16, checkpoint_blocks=blocks)


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for backward after one forward: the activation
    memory that decides a step's peak."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    return sum(storages.values())


def test_checkpointed_blocks_keep_far_fewer_activations_for_backward():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    plain = _task().build_model().train()
    checkpointed = _task().build_model().train()
    checkpoint_blocks(checkpointed, BLOCKS, "synthetic")
    full, kept = _saved_bytes(plain, x), _saved_bytes(checkpointed, x)
    assert kept < 0.25 * full, (kept, full)  # ResNet-18 here: the four stages hold nearly all activations


def test_training_with_checkpointing_gives_the_same_weights_and_statistics(tmp_path):
    cfg = fast_config(epochs=1, batch_size=8, save_checkpoints=True)  # 4 steps: each one must match
    a = train(_task(), cfg, out_dir=tmp_path / "plain")
    b = train(_task(BLOCKS), cfg, out_dir=tmp_path / "checkpointed")
    assert a.history[-1]["val_loss"] == b.history[-1]["val_loss"]
    wa = ckpt.load_checkpoint(tmp_path / "plain" / "last.pt")["model"]
    wb = ckpt.load_checkpoint(tmp_path / "checkpointed" / "last.pt")["model"]
    assert wa.keys() == wb.keys()  # same names: checkpoints and exports do not change
    assert any("running_mean" in k for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # parameters and BatchNorm running statistics


def test_an_unknown_block_or_a_bad_value_is_named():
    with pytest.raises(TaskError, match=r"checkpoint_blocks names 'layer9', which is not a submodule"):
        checkpoint_blocks(_task().build_model(), ["layer9"], "synthetic")
    with pytest.raises(TaskError, match=r"checkpoint_blocks is 'layer1'; give a list of submodule names"):
        _task("layer1")


def _peak_bytes(model: torch.nn.Module, x: torch.Tensor, tmp_path) -> int:
    """The CPU allocator's peak during one forward and backward, above what was allocated before:
    torch.profiler's memory events carry the running total."""
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).sum().backward()
    trace = tmp_path / f"memory_{id(model)}.json"
    prof.export_chrome_trace(str(trace))
    events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before


def _deep_convs() -> torch.nn.Module:
    """Six blocks of four 3x3 convolutions: few weights, many activations (as the models that do
    not fit), so the step's peak is mostly activations."""
    def block() -> torch.nn.Sequential:
        return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Conv2d(8, 8, 3, padding=1),
                                                                    torch.nn.ReLU())])
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), *[block() for _ in range(6)])


def test_checkpointed_blocks_lower_the_peak_memory_of_a_step(tmp_path):
    x = torch.randn(16, 3, 64, 64)
    plain, checkpointed = _deep_convs().train(), _deep_convs().train()
    checkpoint_blocks(checkpointed, ["1", "2", "3", "4", "5", "6"], "deep")
    full, peak = _peak_bytes(plain, x, tmp_path), _peak_bytes(checkpointed, x, tmp_path)
    assert peak < 0.6 * full, (peak, full)
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)  # the same gradients from less memory
