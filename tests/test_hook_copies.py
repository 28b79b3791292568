"""Gradient hooks carried onto the copies autoprec trains (``autoprec.hook_copies``)."""

from __future__ import annotations

import torch
from torch import nn

from autoprec.hook_copies import unmapped_hooks
from autoprec.model_copies import deep_copy


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    net.register_buffer("grad_sq", torch.zeros(2, 8))
    return net


def _backward(model: nn.Module) -> None:
    model(torch.randn(3, 4)).sum().backward()


class _Pruner:
    """An object outside the model that holds it."""

    def __init__(self, target: nn.Module) -> None:
        self.target = target

    def hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * (self.target[2].weight.abs() > 0.1)


class _Schedule:
    """An object outside the model that the model keeps too."""

    def __init__(self) -> None:
        self.factor = 0.0

    def hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor


def test_keyword_only_defaults_are_mapped_to_the_copy() -> None:
    """A review: ``def f(g, *, acc=model.grad_sq)`` kept the user's buffer on the copy, and
    every run wrote it."""
    net = _net()

    def accumulate(grad: torch.Tensor, *, acc: torch.Tensor = net.grad_sq) -> None:
        acc.add_(grad.detach() ** 2)

    net[2].weight.register_hook(accumulate)
    copy = deep_copy(net)
    _backward(copy)
    assert copy.grad_sq.any() and not net.grad_sq.any()


def test_a_method_of_an_object_holding_the_model_is_not_carried() -> None:
    """A review: a pruner's ``self.target`` read the user's weights in every trial."""
    net = _net()
    net[2].weight.register_hook(_Pruner(net).hook)
    assert unmapped_hooks(net) == ["2.weight"]
    assert not deep_copy(net)[2].weight._backward_hooks


def test_attribute_names_are_not_module_level_names() -> None:
    """A review: ``co_names`` holds attribute names too, so a method reading ``self.model``
    was left out where a script had a global named ``model``."""
    global model
    net = _net()

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = net

        def masked(self, grad: torch.Tensor) -> torch.Tensor:
            return grad * (self.model.grad_sq.sum() >= 0)

    holder = Holder()
    model = holder  # the script's name for its model, the attribute's name too
    net[2].weight.register_hook(holder.masked)
    assert unmapped_hooks(holder) == []
    del model


def test_only_the_models_objects_are_swapped_for_the_copys() -> None:
    """A review: an object the hook holds that the model keeps too was swapped for the copy's
    (its factor 0), while the user's code drives the user's."""
    net = _net()
    schedule = _Schedule()
    net.schedule = schedule  # kept on the model as a plain attribute
    net[2].weight.register_hook(lambda grad: schedule.hook(grad))
    copy = deep_copy(net)
    schedule.factor = 1.0
    _backward(copy)
    assert copy[2].weight.grad.abs().sum() > 0
