"""Pure bf16's forward cost at a converged loss, on a selective-scan language model.

``python -m benchmarks.bf16_converged_cost`` (about 4 minutes on one core; ``--runs`` adds the
modes' own 1500-step runs, about 10 minutes more; ``--quick`` runs in CI and only checks that
it runs).

Found by a hunt (2026-11-29): on a small LM whose mixers are a Mamba-2-like selective scan
written in plain torch (a ``cumsum`` of log-decays, then ``exp`` of their differences), the
bf16-weight modes passed ``autoprec.check()`` from the initial weights, with a forward cost of
0.0%, and every one of their 1500-step runs ended above every fp32 run. Pure bf16 computes the
scan in bf16 (autocast would run ``cumsum`` and ``exp`` in fp32): its cost is a floor of the
bf16 forward that shows only once the loss has fallen, as FP8's does (``fp8_cost_split``).

The benchmark trains the model in fp32 (AdamW, lr 3e-3, batches drawn at random), reads the test
loss of fp32's weights at the start and at the end in fp32 and in pure bf16 (the probe's
keep-list; and with the scan modules, ``blocks.*.mix``, kept in fp32 too), and runs ``check()``
on bf16_sr and bf16_kahan from the initial weights and from the trained ones. ``--runs`` trains
each mode through ``apply()`` as a user would, and prints its test loss beside fp32's at other
batch orders.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import autoprec
from autoprec.layer_keep import PURE_BF16_KEEP_REASONS
from autoprec.specs import ModeSpec

VOCAB, WIDTH, HEADS, STATE, LENGTH, BATCH, LAG = 64, 64, 4, 16, 128, 16, 8
LR = 3e-3
MODES = ("bf16_sr", "bf16_kahan")


class SelectiveScan(nn.Module):
    """A Mamba-2-like mixer: a scalar decay per head, computed as ``exp`` of differences of a
    ``cumsum`` of log-decays (the segment-sum form)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 2 * WIDTH)
        self.bc = nn.Linear(WIDTH, 2 * STATE)
        self.dt = nn.Linear(WIDTH, HEADS)
        self.a_log = nn.Parameter(torch.log(torch.linspace(1, 8, HEADS)))
        self.skip = nn.Parameter(torch.ones(HEADS))
        self.out = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.dt.bias.copy_(torch.log(torch.expm1(torch.linspace(0.01, 0.1, HEADS))))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = u.shape
        x, z = self.inp(u).chunk(2, -1)
        b, c = self.bc(u).chunk(2, -1)
        dt = F.softplus(self.dt(u))
        log_decay = dt * -torch.exp(self.a_log)
        xh = x.view(batch, steps, HEADS, WIDTH // HEADS) * dt[..., None]
        cum = torch.cumsum(log_decay, dim=1)
        mask = torch.tril(torch.ones(steps, steps, dtype=torch.bool, device=u.device))
        diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(
            ~mask[None, :, :, None], -math.inf
        )
        weights = torch.exp(diff) * torch.einsum("btn,bsn->bts", c, b)[..., None]
        y = torch.einsum("btsh,bshp->bthp", weights, xh) + xh * self.skip[None, None, :, None]
        return self.out(y.reshape(batch, steps, WIDTH) * F.silu(z))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.mix = SelectiveScan()
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.n1(x))
        return x + self.mlp(self.n2(x))


class ScanLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model() -> ScanLM:
    torch.manual_seed(0)
    return ScanLM()


def make_batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Tokens that are a noisy function of the token ``LAG`` back: the scan must carry them."""
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(99))
    seq = torch.randint(0, VOCAB, (count * BATCH, LENGTH + 1), generator=generator)
    noise = torch.rand(count * BATCH, LENGTH + 1, generator=generator) < 0.2
    for t in range(LAG, LENGTH + 1):
        seq[:, t] = torch.where(noise[:, t], seq[:, t], permutation[seq[:, t - LAG]])
    return [(seq[i : i + BATCH, :-1], seq[i : i + BATCH, 1:]) for i in range(0, len(seq), BATCH)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def train(plan: autoprec.PrecisionPlan, batches: list, steps: int, seed: int) -> None:
    """``steps`` steps of the plan on batches drawn at random (``seed``: the order)."""
    order = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    for _ in range(steps):
        x, y = batches[int(torch.randint(0, len(batches), (1,), generator=order))]
        with plan.autocast():
            out = plan.model(x)
        plan.step(loss_fn(out, y))


def test_loss(model: nn.Module, spec: ModeSpec | None, test: list) -> float:
    """Mean test loss of ``model`` read as it is (``spec`` None) or in ``spec``."""
    copied = copy.deepcopy(model)
    if spec is not None:
        copied = (
            autoprec.profile_for(spec).apply(copied, torch.optim.SGD(copied.parameters())).model
        )
    copied.eval()
    with torch.no_grad():
        return sum(loss_fn(copied(x), y).item() for x, y in test) / len(test)


class Reads(NamedTuple):
    """Test losses of one set of weights, read three ways."""

    fp32: float
    pure_bf16: float
    """In pure bf16 with the probe's keep-list."""
    scan_kept: float
    """The same with the scan modules kept in fp32 too."""

    def __str__(self) -> str:
        cost, kept = self.pure_bf16 / self.fp32 - 1, self.scan_kept / self.fp32 - 1
        return (
            f"fp32 {self.fp32:.4f}, pure bf16 {self.pure_bf16:.4f} ({cost * 100:+.2f}%), with "
            f"the scan kept fp32 {self.scan_kept:.4f} ({kept * 100:+.2f}%)"
        )


def reads(model: nn.Module, keep: tuple[str, ...], test: list) -> Reads:
    return Reads(
        test_loss(model, None, test),
        test_loss(model, ModeSpec(mode="bf16_pure", keep_fp32=keep), test),
        test_loss(model, ModeSpec(mode="bf16_pure", keep_fp32=(*keep, "blocks.*.mix")), test),
    )


def checked(model: nn.Module, batches: list, steps: int) -> dict[str, tuple[str, float | None]]:
    """label -> (status, forward cost) of check() on the modes from ``model``'s weights."""
    report = autoprec.check(
        model, batches, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
        steps=steps, modes=list(MODES), progress=False,
    )  # fmt: skip
    found = {v.spec.label: (v.status, v.drift.get("forward_cost")) for v in report.verdicts}
    for verdict in report.verdicts:
        cost = verdict.drift.get("forward_cost")
        shown = "n/a" if cost is None else f"{cost * 100:+.2f}%"
        print(f"    {verdict.spec.label}: {verdict.status}, forward cost {shown}")
        for reason in verdict.reasons:
            print(f"        {reason[:160]}")
    return found


class Result(NamedTuple):
    start: Reads
    end: Reads
    from_start: dict[str, tuple[str, float | None]]
    from_end: dict[str, tuple[str, float | None]]


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="fp32 training steps")
    parser.add_argument("--check-steps", type=int, default=200)
    parser.add_argument("--runs", action="store_true", help="train each mode through apply()")
    parser.add_argument("--quick", action="store_true", help="CI: 40 steps, 20-step checks")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.check_steps, args.runs = 40, 20, False
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    batches, test = make_batches(240, seed=1), make_batches(20, seed=2)
    model = make_model()
    layers = autoprec.probe(model, example_input=batches[0][0]).layers
    assert layers is not None
    keep = layers.kept_for(PURE_BF16_KEEP_REASONS)
    print(f"pure bf16 keeps in fp32 (the probe): {', '.join(keep)}")
    start = reads(model, keep, test)
    print(f"step 0: {start}")
    print(f"check() from the initial weights, {args.check_steps} steps:")
    from_start = checked(model, batches[:60], args.check_steps)
    started = time.perf_counter()
    trained = make_model()
    plan = autoprec.profile_for(ModeSpec(mode="fp32")).apply(
        trained, torch.optim.AdamW(trained.parameters(), lr=LR)
    )
    train(plan, batches, args.steps, seed=0)
    print(f"fp32 trained {args.steps} steps ({time.perf_counter() - started:.0f} s)")
    end = reads(plan.model, keep, test)
    print(f"step {args.steps}: {end}")
    print(f"check() from the trained weights, {args.check_steps // 2} steps at lr {LR}:")
    from_end = checked(plan.model, batches[:60], args.check_steps // 2)
    if args.runs:
        runs = [
            ("fp32", 0),
            ("fp32", 1),
            ("fp32", 2),
            ("bf16_sr", 0),
            ("bf16_sr", 1),
            ("bf16_kahan", 0),
        ]
        print(f"each mode's own {args.steps}-step run through apply() (seed: the batch order):")
        for mode, seed in runs:
            model = make_model()
            spec = ModeSpec(mode=mode, keep_fp32=keep if mode != "fp32" else ())
            plan = autoprec.profile_for(spec).apply(
                model, torch.optim.AdamW(model.parameters(), lr=LR)
            )
            train(plan, batches, args.steps, seed=seed)
            read = test_loss(plan.model, None, test)  # as it trained
            in_fp32 = test_loss(copy.deepcopy(plan.model).float(), None, test)
            print(f"    {mode} seed {seed}: test loss {read:.4f} (read in fp32 {in_fp32:.4f})")
    return Result(start, end, from_start, from_end)


if __name__ == "__main__":
    main()
