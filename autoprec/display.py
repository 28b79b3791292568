"""Readable terminal output with rich: profiles, tune and quality-screen tables, and the number
formats every table shares (display_probe holds the probe's). Only the CLI imports it."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from autoprec.drift import shown_forward_cost
from autoprec.modes import MODE_CLASSES
from autoprec.modes.pure_bf16 import Bf16PureMode
from autoprec.profile import Profile, TrialFigures
from autoprec.recipe import RecipeSummary
from autoprec.screening import QualityReport
from autoprec.specs import MODE_DESCRIPTIONS, OWN_8BIT_MODES, ModeSpec
from autoprec.tune_result import TuneResult, trial_count


def format_bytes(count: int | None) -> str:
    """GiB from 1 GiB up (as printed: 1 GiB less 16 KiB read "1024.0 MiB"; a hunt), else MiB
    (a 17 MiB peak printed "peak 0.0 GiB" on an H200)."""
    if count is None:
        return "?"
    if abs(round(count / 2**20, 1)) < 1024:
        return f"{count / 2**20:.1f} MiB"
    return f"{count / 2**30:.1f} GiB"


def optimizer_states(spec: ModeSpec) -> str:
    """What the mode keeps the optimizer's states in: a pure-bf16 mode's are bf16 like its
    weights (its "32-bit" optimizer_bits means "not 8-bit"; shown as such, the states the
    gate's state rule is about read as fp32)."""
    if spec.optimizer_bits == 8 and spec.mode in OWN_8BIT_MODES:
        return "8-bit (bitsandbytes' format, in autoprec's stochastic-rounding optimizer)"
    if spec.optimizer_bits == 8:
        return "8-bit (bitsandbytes)"
    mode = MODE_CLASSES[spec.mode]
    if not issubclass(mode, Bf16PureMode):
        return "32-bit"
    rounding = (
        "stochastically rounded" if mode.state_rounding == "stochastic" else "rounded to nearest"
    )
    if mode.fp32_second_moment:
        return f"bf16, {rounding} (as the weights); Adam's second moment fp32"
    return f"bf16, {rounding} (as the weights)"


def format_count(number: int | None) -> str:
    if number is None:
        return "?"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        # as printed below it: 999,999 read "1000.00k" (a hunt); 999 stays 999
        if number >= size or (size > 1e3 and number >= size * (1 - 5e-6)):
            return f"{number / size:.2f}{unit}"
    return str(number)


def format_percent(share: float | None) -> str:
    return "?" if share is None else f"{share * 100:.1f}%"


def yes_no(flag: bool) -> Text:
    return Text("yes", style="green") if flag else Text("no", style="red")


def _figures(figures: TrialFigures) -> str:
    parts = []
    if figures.samples_per_second is not None:
        parts.append(f"{figures.samples_per_second:,.1f} samples/s")
    if figures.peak_memory_bytes is not None:
        parts.append(f"peak {format_bytes(figures.peak_memory_bytes)}")
    if figures.state_bytes is not None:
        parts.append(f"state {format_bytes(figures.state_bytes)}")
    if figures.activation_bytes is not None:
        parts.append(f"saved activations {format_bytes(figures.activation_bytes)}")
    if figures.final_loss is not None:
        parts.append(f"loss {figures.final_loss:.4g}")
    return ", ".join(parts) or "—"


RECIPE_OPTIONS = ("lr", "betas", "beta1", "beta2", "momentum", "nesterov", "weight_decay")
"""The optimizer settings a recipe line shows: the lr and what sets its momentum and decay
(torch's betas, torch-optimi's beta1/beta2, SGD's momentum and nesterov when on)."""


def describe_recipe(recipe: RecipeSummary) -> str:
    """One paragraph: the optimizer, the lrs trials trained at, accumulation and clipping."""
    optimizer = recipe.optimizer.rpartition(":")[2]
    group = recipe.optimizer_groups[0] if recipe.optimizer_groups else {}
    options = ", ".join(
        f"{key} {group[key]}"
        for key in RECIPE_OPTIONS
        if key in group and (key != "nesterov" or group[key] is True)
    )
    more = (
        f" (+{len(recipe.optimizer_groups) - 1} groups)" if len(recipe.optimizer_groups) > 1 else ""
    )
    parts = [f"{optimizer}({options}){more}"]
    if recipe.optimizer_state_steps is not None:  # (found by a hunt: only --json said so)
        parts.append(f"from your optimizer state ({recipe.optimizer_state_steps} steps)")
    if recipe.scheduler is not None:
        parts.append(
            f"schedule {recipe.scheduler.rpartition(':')[2]} over {recipe.total_steps} steps"
        )
    legs = "; ".join(point.describe() for point in recipe.lr_points)
    parts.append(f"trials trained at {legs}")
    if recipe.grad_accumulation_steps > 1:
        parts.append(f"{recipe.grad_accumulation_steps} micro-batches per step")
    if recipe.clip_grad_norm is not None:
        parts.append(f"clip {recipe.clip_grad_norm:g}")
    return "; ".join(parts)


def print_profile(
    profile: Profile, warnings: list[str] | None = None, console: Console | None = None
) -> None:
    """Print a Profile: the recipe, where it was proven, and the evidence."""
    console = console or Console()
    spec = profile.spec
    table = Table(title=f"Profile: {spec.label}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("mode", Text(f"{spec.mode} — {MODE_DESCRIPTIONS[spec.mode]}"))
    table.add_row("optimizer states", optimizer_states(spec))
    if spec.fp8_recipe:
        recipe = spec.fp8_recipe + (" (emulated)" if spec.emulate else "")
        if spec.te_delayed_scaling is not None:
            delayed = spec.te_delayed_scaling
            recipe += (
                f": amax history {delayed.amax_history_len}, "
                f"{delayed.amax_compute_algo}, margin {delayed.margin}"
            )
        table.add_row("FP8 recipe", Text(recipe))
    table.add_row("keep in fp32", Text(", ".join(spec.keep_fp32) or "none"))
    if spec.fp8_skip:
        table.add_row("kept out of FP8 (bf16)", Text(", ".join(spec.fp8_skip)))
    compiled = "yes: apply() compiles the model" if spec.compile else "no"
    table.add_row("torch.compile", Text(compiled))
    hardware = profile.hardware
    where = (
        f"{hardware.gpu_name} (capability {hardware.capability[0]}.{hardware.capability[1]})"
        if hardware.gpu_name and hardware.capability
        else f"CPU: {hardware.cpu_model}"
    )
    table.add_row("proven on", Text(f"{where}; torch {hardware.torch_version}"))
    if profile.model is not None:
        table.add_row(
            "model",
            f"{profile.model.model_class}, {format_count(profile.model.parameters)} "
            f"parameters (digest {profile.model.layer_mix_digest})",
        )
    if profile.recipe is not None:
        table.add_row("tuned under", Text(describe_recipe(profile.recipe)))
    evidence = profile.evidence
    if evidence is None:
        table.add_row("evidence", Text("none (not measured by autoprec tune)", style="yellow"))
    else:
        table.add_row("reference (fp32)", _figures(evidence.reference))
        table.add_row("chosen", _figures(evidence.chosen))
        drift = ", ".join(f"{name} {value:.4g}" for name, value in evidence.drift.items())
        table.add_row("drift", drift or "—")
        budget = f"{evidence.trial_count} trials of {evidence.trial_steps} steps"
        if evidence.trials_from_study:
            budget += f" ({evidence.trials_from_study} from an earlier run of the study)"
        if evidence.budget_used_seconds is not None:
            budget += f", {evidence.budget_used_seconds:.0f} s used"
            budget += " by the last run" if evidence.trials_from_study else ""
        table.add_row("search", budget)
        for spot in evidence.blind_spots:
            table.add_row("not seen by a short trial", Text(spot, style="yellow"))
        for note in evidence.notes:
            table.add_row("gate note", Text(note, style="yellow"))
    table.add_row(
        "created",
        f"{profile.created_at:%Y-%m-%d %H:%M} UTC by autoprec "
        f"{profile.autoprec_version} (schema {profile.schema_version})",
    )
    if profile.note:
        table.add_row("note", Text(profile.note))
    console.print(table)
    for warning in warnings or []:
        console.print(Panel(Text(warning), title="hardware differs", style="yellow"))


_STATUS_STYLE = {
    "accepted": "green",
    "rejected": "red",
    "pruned": "yellow",
    "failed": "red",
    "stopped": "yellow",
}


RETIMED_MARK = " ↻"
"""After a speed figure that comes from side-by-side re-timings, not from the mode's trial."""


def _budget_caption(result: TuneResult) -> str:
    budget = result.budget
    retimed = (
        f"\n{RETIMED_MARK.strip()} re-timed side by side: only these compete on speed (a "
        "re-timing and a trial are different measures)"
        if any(o.retimed for o in (result.reference, *result.trials))
        else ""
    )
    return (
        f"{budget.used_seconds:.0f} s of {budget.budget_seconds:.0f} s: calibration "
        f"{budget.calibration_seconds:.0f} s, fp32 reference + noise "
        f"{budget.reference_seconds:.0f} s, search {budget.search_seconds:.0f} s; "
        + trial_count(budget)
        + retimed
        + "".join(f"\nnote: {note}" for note in result.checks_not_run)
        + "".join(f"\nadvice: {advice}" for advice in result.advice)
    )


def _memory_header(result: TuneResult) -> str:
    kind = result.reference.memory_kind
    return {"cuda_peak": "peak MiB", "state_and_activations": "state+act MiB"}.get(
        kind or "", "state MiB"
    )


def _trial_rows(result: TuneResult) -> list[tuple[Text, Text, str, str, list[str]]]:
    rows = []
    for outcome in (result.reference, *result.trials):
        chosen = outcome.spec == result.chosen
        label = Text(
            ("★ " if chosen else "  ") + outcome.label, style="bold green" if chosen else ""
        )
        speed = f"{outcome.samples_per_second:,.1f}" if outcome.samples_per_second else "—"
        if outcome.samples_per_second and outcome.retimed:
            speed += RETIMED_MARK
        memory = f"{outcome.memory_bytes / 2**20:,.2f}" if outcome.memory_bytes else "—"
        status = Text(outcome.status, style=_STATUS_STYLE[outcome.status])
        rows.append((label, status, speed, memory, [*outcome.reasons, *result.own_notes(outcome)]))
    return rows


def tune_table(result: TuneResult, *, wide: bool = False) -> Table | Group:
    """Every trial with its verdict; the chosen one marked with ★.

    Compact (default): one row per trial with full mode labels and the first reason cut to the
    terminal's width, skipped modes one short line each below. ``wide``: every reason, every
    skipped mode's reasons.
    """
    table = Table(
        title=f"Trials (objective: {result.objective})",
        title_justify="left",
        show_lines=wide,
        caption=_budget_caption(result),
        caption_justify="left",
        expand=not wide,  # compact: the fixed columns keep their width, "why" gets the rest
        box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
        show_edge=wide,
        pad_edge=wide,
        collapse_padding=not wide,
    )
    table.add_column("mode", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("samples/s", justify="right", no_wrap=True)
    table.add_column(_memory_header(result), justify="right", no_wrap=True)
    if wide:
        table.add_column("why")
    else:
        table.add_column("why", no_wrap=True, overflow="ellipsis", ratio=1, min_width=8)
    rows = _trial_rows(result)
    for label, status, speed, memory, reasons in rows:
        why = "\n".join(reasons) if wide else (reasons[0] if reasons else "")
        table.add_row(label, status, speed, memory, Text(why))
    if wide:
        for skipped in result.skipped:
            table.add_row(
                Text("  " + skipped.spec.label, style="dim"),
                Text("skipped", style="dim"),
                "—",
                "—",
                Text("\n".join(skipped.reasons), style="dim"),
            )
        return table
    lines = [
        Text(
            f"skipped {skipped.spec.label}: {skipped.reasons[0] if skipped.reasons else ''}",
            style="dim",
            no_wrap=True,
            overflow="ellipsis",
        )
        for skipped in result.skipped
    ]
    if any(reasons for *_, reasons in rows) or result.skipped:  # a long one is cut short too
        lines.append(Text("(--wide shows every reason)", style="dim"))
    return Group(table, *lines)


_SCREEN_STYLE = {"safe": "green", "unsafe": "red", "failed": "red", "stopped": "yellow"}


def quality_table(report: QualityReport) -> Group:
    """The quality screen: every mode safe / unsafe / failed with every reason; the modes that
    could not run here one line each."""
    table = Table(
        title=f"Quality screen: {report.steps} steps per mode on {report.device}, against fp32",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        expand=True,
    )
    table.add_column("verdict", no_wrap=True)
    table.add_column("mode, and why", ratio=1)
    spots: list[str] = []  # each blind spot once, below the table, numbered
    for verdict in report.verdicts:
        why = Text(verdict.label, style="bold")
        shown = shown_forward_cost(verdict.drift)
        if shown:
            why.append(f"  forward cost {shown}", style="dim")
        if verdict.spec.keep_fp32:
            why.append(f"\n◦ kept in fp32: {', '.join(verdict.spec.keep_fp32)}", style="dim")
        for reason in verdict.reasons:
            why.append(f"\n• {reason}")
        for spot in verdict.blind_spots:
            if spot not in spots:
                spots.append(spot)
            why.append(f"\n◦ not seen by a short trial: [{spots.index(spot) + 1}]", style="yellow")
        for note in report.own_notes(verdict):  # those every mode shares: once, below
            why.append(f"\n◦ {note}", style="dim")
        table.add_row(Text(verdict.status, style=_SCREEN_STYLE[verdict.status]), why)
    lines: list[Text] = [Text(f"[{n}] {spot}", style="yellow") for n, spot in enumerate(spots, 1)]
    lines += [
        Text(f"not checked {skipped.spec.label}: {'; '.join(skipped.reasons)}", style="dim")
        for skipped in report.not_checked
    ]
    lines += [Text(f"note: {note}", style="dim") for note in report.checks_not_run]
    lines.append(
        Text(
            f"trained under: {describe_recipe(report.recipe)}; {report.seconds:.0f} s. Safe is "
            "about quality only: `autoprec tune` measures which safe mode is fastest.",
            style="dim",
        )
    )
    return Group(table, *lines)
