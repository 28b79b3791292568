"""Models that call their modules under torch.vmap (ensembles, per-element networks): the
held-out pass and the probe's FP8 fit (found by a hunt)."""

from __future__ import annotations

import torch
from torch import nn

import autoprec


class PerElement(nn.Module):
    """A set model: ``phi`` runs on each of 4 elements under ``torch.vmap``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.phi = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 4, 16)
        h = torch.vmap(self.phi)(self.embed(x).transpose(0, 1)).sum(0)
        return self.head(torch.relu(self.mid(h)))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(16, 4, 16, generator=generator), torch.randn(16, 1, generator=generator))
        for _ in range(6)
    ]


def test_the_probe_keeps_linears_called_under_vmap_out_of_fp8() -> None:
    # torchao's Float8Linear has no vmap rule: the trial failed at its first step
    torch.manual_seed(0)
    layers = autoprec.probe(PerElement(), example_input=_data()[0][0]).layers
    assert layers is not None
    fit = {linear.fqn: linear.fp8_compatible for linear in layers.linears}
    assert fit == {"embed": True, "phi.0": False, "phi.2": False, "mid": True, "head": False}
    assert {linear.fqn for linear in layers.linears if linear.under_transform} == {"phi.0", "phi.2"}
    kept = {entry.fqn: entry.reason for entry in layers.keep_fp32}
    assert kept["phi.0"].startswith("Linear called under torch.vmap")
    assert "mid" not in kept


def test_check_runs_a_model_that_vmaps_a_submodule_in_every_watched_mode() -> None:
    # the held-out pass stacked maxima kept inside vmap: "maybe_level.has_value() INTERNAL
    # ASSERT FAILED" lost the fp32 reference's run, and amp_fp16's op watch the same way
    torch.manual_seed(0)
    model = PerElement()
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    report = autoprec.check(
        model,
        _data(),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss_fn=nn.functional.mse_loss,
        modes=["amp_fp16", "fp8_torchao"],
        steps=6,
        progress=False,
    )
    statuses = {verdict.spec.mode: verdict.status for verdict in report.verdicts}
    assert statuses == {"amp_fp16": "safe", "fp8_torchao": "safe"}, report.summary()
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
