"""The drift gate's check of state outside the optimizer: buffers and frozen weights training
changed in the fp32 reference that the trial holds in a narrower dtype; parameters the optimizer
holds but never steps (no loss reaches them, so they get no gradient) count as outside it.

Running statistics the forward pass updates are found by the probe and kept fp32 for pure bf16
(``autoprec.running_state``); state your ``train_step`` updates (a mean teacher's EMA weights,
a float step counter) or the model's root module holds is not (unless you name its module in
``keep_fp32``), and pure bf16 casts it to bf16,
where every update rounds to nearest whatever rounding the optimizer uses. An EMA's small
updates then vanish: a running mean of momentum 1e-3 stopped at 4.92 where fp32's reached 19.00
and held-out loss ended 2.8x fp32's (``python -m benchmarks.running_state_rounding``). The
trial is too short to show that (its mean was still moving), so this is a rule on what the
reference shows training changes, not a measurement of the trial.
"""

from __future__ import annotations

import math

from autoprec._wording import first_names
from autoprec.trial_records import StateDigest, TrialResult

NARROW_DTYPES = ("torch.bfloat16", "torch.float16")
WIDE_DTYPES = ("torch.float32", "torch.float64")


def changed_state(result: TrialResult) -> list[str]:
    """Names of the state outside the optimizer that ``result``'s training changed, and of the
    state it created that changed after its first step: a buffer registered as None and set
    at the first batch (a running mean, a memory) had no digest at the start, and the rule
    never saw it (found by a hunt: bf16_sr accepted with the buffer None at the start,
    rejected with it zeros); one built once and kept (a causal mask) is no state that
    training changes (a review: its first version rejected bf16_sr for it)."""
    if len(result.outside_state) < 2:
        return []
    start, end = result.outside_state[0], result.outside_state[-1]
    changed = [name for name, digest in start.items() if not _same(end.get(name, digest), digest)]
    first = result.outside_state[1] if len(result.outside_state) > 2 else {}
    return changed + [
        name
        for name, digest in end.items()
        if name not in start and name in first and not _same(first[name], digest)
    ]


def _same(first: StateDigest, second: StateDigest) -> bool:
    """Equal digests, a NaN equal to a NaN (a constant table holding NaN never changes)."""
    return first.dtype == second.dtype and all(
        a == b or (math.isnan(a) and math.isnan(b))
        for a, b in ((first.total, second.total), (first.norm, second.norm))
    )


def _narrowed(trial: TrialResult, reference: TrialResult) -> dict[str, list[str]]:
    """dtype -> names the reference changed in fp32 that the trial holds in that dtype."""
    if not trial.outside_state or not reference.outside_state:
        return {}
    # at the start, or at the end for state training created
    held = {**trial.outside_state[-1], **trial.outside_state[0]}
    reference_held = {**reference.outside_state[-1], **reference.outside_state[0]}
    narrowed: dict[str, list[str]] = {}
    for name in changed_state(reference):
        digest = held.get(name)
        # float64 state too (a running mean kept in double): held in bf16 it was not flagged
        if digest is None or reference_held[name].dtype not in WIDE_DTYPES:
            continue
        if digest.dtype in NARROW_DTYPES:
            narrowed.setdefault(digest.dtype.removeprefix("torch."), []).append(name)
    return narrowed


def _way_out(names: list[str]) -> str:
    """How to keep ``names`` in fp32: their modules through keep_fp32; state on the model's
    root module cannot be kept apart from the model."""
    owners = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in names if "." in name))
    if not owners:
        return (
            "Keep it in fp32 by holding it in a submodule whose own forward reads and updates "
            "it, then naming that in keep_fp32 (keep_fp32 names modules, which run in fp32 "
            "where they are called; the model's root module cannot be kept apart from the "
            "model)"
        )
    shown = first_names([repr(owner) for owner in owners], 4)
    on_root = [name for name in names if "." not in name]
    # state on the root beside a submodule's: naming the submodule alone still left the mode
    # rejected (found by a hunt)
    root = (
        f"; {', '.join(on_root[:4])} on the model's root module cannot be kept apart from the "
        "model: move it into a submodule whose own forward reads and updates it"
        if on_root
        else ""
    )
    return (
        f"Keep it in fp32: tune(..., keep_fp32=[{shown}]) or check(...) alike (CLI: "
        f"--keep-fp32 NAME), or a name matching their parent (a kept module runs in fp32 "
        f"where it is called: one nothing calls, whose owner reads its buffers, is kept by "
        f"keeping that owner){root}"
    )


def outside_state_reasons(trial: TrialResult, reference: TrialResult) -> list[str]:
    """One reason per narrow dtype holding state the reference's training changed."""
    reasons = []
    for dtype, names in _narrowed(trial, reference).items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        reasons.append(
            f"state outside the optimizer held in {dtype}: training changes {shown} (buffers, "
            "frozen weights or weights no loss reaches, which the optimizer never steps, that "
            "your forward or train_step updates, such as a teacher's EMA), "
            f"and in {dtype} every update rounds to nearest, so an average's small ones vanish "
            "(a running mean of momentum 1e-3 stopped at 4.92 of fp32's 19.00: python -m "
            "benchmarks.running_state_rounding); state only ever copied whole (a target "
            "network copied from the online one) loses nothing, but this rule cannot tell "
            f"the two apart. {_way_out(names)}"
        )
    return reasons
